"""The page's own JavaScript and CSS, kept as files in assets/ so that they read, and lint, as what they are.
A `__NAME__` in one is filled in with a Python value, written as JSON (a JavaScript literal)."""

from __future__ import annotations

import json
from typing import Any

from ..call_settings import ASSETS


def asset_text(name: str, **values: Any) -> str:
    """assets/<name>, each `__KEY__` replaced by `values[KEY]` as JSON."""
    text = (ASSETS / name).read_text(encoding="utf-8")
    for key, value in values.items():
        text = text.replace(f"__{key}__", json.dumps(value))
    return text


def page_script(name: str, **values: Any) -> str:
    """assets/<name> as a <script> element for the page's head."""
    return f"<script>\n{asset_text(name, **values)}</script>\n"
