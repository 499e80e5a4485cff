"""The page's call settings, as one named tuple shared by the page (web/page.py) and the handler, and
the call request they make. fastrtc passes the stream's inputs as a list in the page's order; the
handler reads them back by name, so neither side depends on a position the other chose.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from ..call_settings import DEFAULT_VOICE, SamplingParams
from ..errors import CallerError


class PageInputs(NamedTuple):
    voice: Any
    persona: Any
    text_temperature: Any
    text_top_k: Any
    audio_temperature: Any
    audio_top_k: Any
    seed: Any  # -1, None or "": a new random seed per call


@dataclass(frozen=True)
class CallRequest:
    voice: str
    persona: str
    sampling: SamplingParams

    @classmethod
    def from_args(cls, args: list) -> CallRequest:
        """The request the page's inputs make (the defaults, with a new seed, before it sent any). The
        inputs are at the END of fastrtc's `latest_args`, whose head differs between the Gradio page
        (`__webrtc_value__`, connection id, inputs...) and `Stream.set_input` (`__webrtc_value__`,
        inputs...)."""
        n = len(PageInputs._fields)
        if len(args) < n + 1:
            return cls(DEFAULT_VOICE, "", SamplingParams(seed=new_seed()))
        page = PageInputs(*args[-n:])
        seed = page.seed
        try:
            sampling = SamplingParams(text_temperature=float(page.text_temperature), text_top_k=int(page.text_top_k),
                                      audio_temperature=float(page.audio_temperature),
                                      audio_top_k=int(page.audio_top_k),
                                      seed=new_seed() if seed in (None, "", -1) else int(seed))
        except (TypeError, ValueError) as e:
            raise CallerError(f"the sampling settings must be numbers: {e}") from e
        return cls(str(page.voice or DEFAULT_VOICE), str(page.persona or ""), sampling)

    def recording_meta(self, call_id: str, model: str) -> dict[str, Any]:
        """The call's settings, as they head its transcript JSON (documented in docs/transcripts.md)."""
        return {"call_id": call_id, "model": model, "voice": self.voice, "persona": self.persona,
                "sampling": asdict(self.sampling)}


def new_seed() -> int:
    """A seed for a caller who asked for a random one, drawn here so that the transcript JSON keeps it."""
    return secrets.randbits(32)
