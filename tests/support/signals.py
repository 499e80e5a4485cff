"""Deterministic test signals and hash-v1 weights shared by the golden fixtures, the tests and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from personaplex_demo.frame import FRAME_SAMPLES, SAMPLE_RATE
from personaplex_demo.model.hashinit import hash_tensor, hash_u32, rule


def mimi_input(n_frames: int, seed: int) -> np.ndarray:
    """Test signal "mimi-input-v1": a chirp with an envelope plus hashed noise, [n_frames, 1920]."""
    n = n_frames * FRAME_SAMPLES
    t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
    total = n / SAMPLE_RATE
    phase = 2.0 * math.pi * (100.0 * t + (3000.0 - 100.0) * t * t / (2.0 * total))
    env = 0.6 + 0.4 * np.sin(2.0 * math.pi * 0.5 * t)
    noise = 2.0 * (hash_u32("mimi-input-noise", seed, n).astype(np.float64) / 4294967296.0) - 1.0
    s = 0.4 * env * np.sin(phase) + 0.1 * noise
    return (np.clip(np.round(s * 32768.0), -32768, 32767) / 32768.0).astype(np.float32).reshape(n_frames, FRAME_SAMPLES)


def make_tensor(kind: str, key: str, shape: Sequence[int], seed: int) -> np.ndarray:
    """The hash-v1 tensor of a checkpoint key (tests/golden/README.md §1)."""
    return hash_tensor(key, seed, shape, *rule(kind, key, shape))
