"""The names of PersonaPlex's voice prompts. Without torch: media worker processes need the
default voice but never load a prompt."""

from __future__ import annotations

import re

VOICE_NAMES: tuple[str, ...] = (
    *(f"NATF{i}" for i in range(4)),
    *(f"NATM{i}" for i in range(4)),
    *(f"VARF{i}" for i in range(5)),
    *(f"VARM{i}" for i in range(5)),
)
DEFAULT_VOICE = "NATF2"
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
