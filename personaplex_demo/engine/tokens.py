"""Special token ids, fixed code frames and the row layout of a lockstep frame (docs/engine.md § Frame layout)."""

from __future__ import annotations

from ..frame import AUDIO_CARD, TEXT_CARD

TEXT_INITIAL = TEXT_CARD  # input-only "initial" text id
AUDIO_INITIAL = AUDIO_CARD  # input-only "initial" audio id; never valid for Mimi
TEXT_PAD = 3  # "zero text": the model is silent in text
TEXT_EPAD = 0  # end of padding
HIDDEN_TEXT_IDS = frozenset({TEXT_EPAD, TEXT_PAD})

# Mimi codes of a silent frame and of the 440 Hz, amplitude-0.5 sine frame.
SILENCE_CODES = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_CODES = (430, 1268, 381, 1611, 1095, 1495, 56, 472)

SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz) of silence before and after the persona

# Rows of one frame: 0 text, 1..8 agent cb0..7, 9..16 user cb0..7.
AGENT_ROWS = slice(1, 9)
USER_ROWS = slice(9, 17)
