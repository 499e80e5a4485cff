"""What the page, `/api/status` and the doors know of the model that serves the room, whether it
runs in this process (`runtime.build.Runtime`) or in engine processes and Ray actors
(`orchestration.engine_process.RemoteRuntime`, built from the facts each engine sends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..call_settings import SamplingParams, persona_token_ids
from ..errors import UnknownVoiceError


class RuntimeFacts(Protocol):
    model_name: str
    is_tiny: bool
    banner: str | None
    weights: str  # "dense" or "int8"

    @property
    def device_name(self) -> str:
        """Where the model runs ("cpu", "cuda:0"; for several engines, the first one's)."""
        ...

    def capacity_facts(self) -> dict[str, Any] | None:
        """How the number of slots was decided (`SlotPlan.as_dict`), or None when nobody planned it."""
        ...


class EngineFacts:
    """The engine as far as the page needs it (voices, persona token counting), from its facts:
    stands in for `runtime.engine` where the engine runs in another process."""

    def __init__(self, facts: dict[str, Any]) -> None:
        from ..runtime.tokenizer import TextTokenizer

        self.voice_names: list[str] = list(facts["voice_names"])
        self.max_persona_tokens: int = int(facts["max_persona_tokens"])
        self.tokenizer = TextTokenizer(Path(facts["tokenizer_path"]))

    def persona_tokens(self, persona: str) -> list[int]:
        return persona_token_ids(self.tokenizer, persona, self.max_persona_tokens)

    def validate_request(self, voice: str, persona: str, sampling: SamplingParams) -> None:
        """What the engines would refuse, refused before the caller waits (as `LockstepEngine`'s)."""
        if voice not in self.voice_names:
            raise UnknownVoiceError(f"unknown voice {str(voice)[:80]!r}; valid voices: {', '.join(self.voice_names)}")
        self.persona_tokens(persona)
        sampling.validate()
