"""The persona presets (label -> text): the examples from NVIDIA's PersonaPlex README, offered by
the page and by name to a phone number's webhook."""

from __future__ import annotations

import functools
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@functools.cache
def load_presets() -> dict[str, str]:
    return json.loads((ASSETS / "personas.json").read_text(encoding="utf-8"))
