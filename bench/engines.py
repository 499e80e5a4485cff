"""Engines and model sizes that only the benchmarks use."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from personaplex_demo.engine.pcm import LockstepEngine  # noqa: E402
from personaplex_demo.model.config import LMConfig  # noqa: E402
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime  # noqa: E402


def build_engine(model: str = "tiny", slots: int = 4, **kwargs) -> LockstepEngine:
    """The engine a `RuntimeOptions(model, slots, ...)` builds, without the rest of the runtime."""
    return build_runtime(RuntimeOptions(model=model, slots=slots, **kwargs)).engine


def mid_lm_config() -> LMConfig:
    """A mid-size LM for CPU benchmarks: about 1/8 of the real width, a quarter of its layers."""
    return LMConfig(dim=512, num_heads=8, num_layers=8, depformer_dim=256, depformer_num_heads=4,
                    depformer_num_layers=4, depformer_dim_feedforward=int(4.125 * 256))
