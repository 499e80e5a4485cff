"""What a caller asks of a call: a voice by name, the sampling settings, as the page and the engine
exchange them, and the persona (a preset, or any text), as the token ids of its system prompt or a
clear refusal.

Without torch: media worker processes build and check these on their event loop, before the caller
waits, and must not import the model code to do it."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CallerError, PersonaTooLongError
from .frame import AUDIO_CARD, TEXT_CARD

VOICE_NAMES: tuple[str, ...] = (
    *(f"NATF{i}" for i in range(4)),
    *(f"NATM{i}" for i in range(4)),
    *(f"VARF{i}" for i in range(5)),
    *(f"VARM{i}" for i in range(5)),
)
DEFAULT_VOICE = "NATF2"
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ASSETS = Path(__file__).resolve().parent / "assets"
MAX_PERSONA_TOKENS = 512
MAX_PERSONA_CHARS = 4000
_CONTROL = {c for c in range(32) if chr(c) not in "\n\t"} | set(range(127, 160))


@dataclass(frozen=True)
class SamplingParams:
    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250
    seed: int | None = None
    greedy: bool = False

    def validate(self) -> None:
        for name in ("text_temperature", "audio_temperature"):
            v = getattr(self, name)
            if not (0.0 <= v <= 5.0) or v != v:
                raise CallerError(f"{name} must be between 0 and 5, got {v}")
        if not (1 <= self.text_top_k <= TEXT_CARD):
            raise CallerError(f"text_top_k must be between 1 and {TEXT_CARD}, got {self.text_top_k}")
        if not (1 <= self.audio_top_k <= AUDIO_CARD):
            raise CallerError(f"audio_top_k must be between 1 and {AUDIO_CARD}, got {self.audio_top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            raise CallerError(f"seed must be between 0 and 4294967295, got {self.seed}")


@functools.cache
def load_presets() -> dict[str, str]:
    """The persona presets (label -> text): the examples from NVIDIA's PersonaPlex README, offered by the
    page and by name to a phone number's webhook."""
    return json.loads((ASSETS / "personas.json").read_text(encoding="utf-8"))


def persona_token_ids(tokenizer, persona: str, max_tokens: int = MAX_PERSONA_TOKENS) -> list[int]:
    """Token ids of the persona's system prompt; raises a CallerError when it is unusable."""
    if not isinstance(persona, str):
        raise CallerError("the persona must be text")
    if len(persona) > MAX_PERSONA_CHARS:
        raise PersonaTooLongError(f"the persona is {len(persona)} characters long; the limit is "
                                  f"{MAX_PERSONA_CHARS} characters ({max_tokens} tokens)")
    try:
        persona.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from JSON's \ud800: the tokenizer cannot take it
        raise CallerError(f"the persona is not valid Unicode text ({exc.reason} at character {exc.start})") from None
    persona = persona.replace("\r\n", "\n").replace("\r", "\n")
    bad = sorted({f"U+{ord(c):04X}" for c in persona if ord(c) in _CONTROL})
    if bad:
        raise CallerError(f"the persona contains control characters ({', '.join(bad[:5])}); "
                          "use plain text, newlines and tabs only")
    ids = tokenizer.encode_persona(persona)
    if len(ids) > max_tokens:
        raise PersonaTooLongError(f"the persona is {len(ids)} tokens long with its <system> tags; the limit "
                                  f"is {max_tokens} tokens")
    return ids
