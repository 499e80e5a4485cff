"""The page's call settings, as one named tuple shared by the page (web/page.py) and the handler.

fastrtc passes the WebRTC stream's inputs to the handler as a list in the order the page lists
them (`rtc.stream(..., inputs=[rtc, *PageInputs(...)])`); the handler reads them back by name
(`PageInputs.from_args`), so neither side depends on a position the other chose.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class PageInputs(NamedTuple):
    voice: Any
    persona: Any
    text_temperature: Any
    text_top_k: Any
    audio_temperature: Any
    audio_top_k: Any
    seed: Any  # -1, None or "": a new random seed per call

    @classmethod
    def from_args(cls, args: list) -> PageInputs | None:
        """The inputs at the END of fastrtc's `latest_args`, or None before the page sent any. The
        head differs between the Gradio page (`__webrtc_value__`, connection id, inputs...) and
        `Stream.set_input` (`__webrtc_value__`, inputs...)."""
        n = len(cls._fields)
        return cls(*args[-n:]) if len(args) >= n + 1 else None
