"""The sampling settings of one call, as the page and the engine exchange them.

A module of its own, without torch: media worker processes build these from the page's inputs
and must not import the model code."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CallerError
from .frame import AUDIO_CARD, TEXT_CARD


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
