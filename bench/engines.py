"""Engines and model sizes that only the benchmarks use."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from personaplex_demo.engine.core import LockstepCore  # noqa: E402
from personaplex_demo.engine.pcm import LockstepEngine, SamplingParams  # noqa: E402
from personaplex_demo.model.config import LMConfig  # noqa: E402
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime  # noqa: E402


def build_engine(model: str = "tiny", slots: int = 4, **kwargs) -> LockstepEngine:
    """The engine a `RuntimeOptions(model, slots, ...)` builds, without the rest of the runtime."""
    return build_runtime(RuntimeOptions(model=model, slots=slots, **kwargs)).engine


def core_stepper(lm, batch: int, voice, persona: list[int], frames: int = 16, **core_kwargs) -> Callable[[], None]:
    """A `LockstepCore` of `batch` live rows (each started with `voice` and `persona`) and a function
    that steps it once, with the next of `frames` random user frames."""
    core = LockstepCore(lm, batch, **core_kwargs)
    for slot in range(batch):
        core.start(slot, voice, persona, SamplingParams(seed=slot), seed=slot)
    g = torch.Generator().manual_seed(batch)
    user = [torch.randint(0, 2048, (batch, 8), generator=g) for _ in range(frames)]
    pos = [0]

    def step() -> None:
        core.step(user[pos[0] % frames])
        pos[0] += 1

    return step


def mid_lm_config() -> LMConfig:
    """A mid-size LM for CPU benchmarks: about 1/8 of the real width, a quarter of its layers."""
    return LMConfig(dim=512, num_heads=8, num_layers=8, depformer_dim=256, depformer_num_heads=4,
                    depformer_num_layers=4, depformer_dim_feedforward=int(4.125 * 256))
