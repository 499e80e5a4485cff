"""Engine costs: tick time vs batch size, and system-prompt prefill stepwise vs fast vs cached.

    .venv/bin/python bench/engine.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import BUDGET_MS, table, time_ms, write_section
from model import hash_load

from personaplex_demo.engine import LockstepCore, SamplingParams, VoiceTokens
from personaplex_demo.loading import build_engine
from personaplex_demo.model.checkpoint import meta_lm
from personaplex_demo.model.config import LMConfig

PERSONA = "You work for CitySan Services which is a waste management and your name is Ayelen Lucero."


def tiny_ticks(batches: list[int], cache: Path) -> list[list[object]]:
    rows = []
    for B in batches:
        engine = build_engine("tiny", slots=B, cache_dir=cache)
        for slot in range(B):
            engine.start_session(slot, engine.voice_names[slot % 18], PERSONA, SamplingParams(seed=slot))
        pcm = (0.1 * np.random.default_rng(0).standard_normal((B, 1920))).astype(np.float32)
        ms = time_ms(lambda: engine.step(pcm), repeat=20)
        rows.append([f"tiny engine tick (Mimi + LM + transcript), B={B}", f"{ms:.1f}", f"{ms / BUDGET_MS:.2f}"])
    return rows


def mid_core(B: int) -> tuple[LockstepCore, VoiceTokens, list[int]]:
    cfg = LMConfig.mid()
    lm = hash_load(meta_lm(cfg), "lm", 1242)
    g = torch.Generator().manual_seed(0)
    voice = VoiceTokens("bench", torch.randn(50, cfg.dim, generator=g), torch.full((17, 4), 100, dtype=torch.long))
    return LockstepCore(lm, B), voice, list(range(200, 260))  # T = 50 voice frames, P = 60 persona tokens


def mid_ticks(batches: list[int]) -> list[list[object]]:
    rows = []
    for B in batches:
        core, voice, persona = mid_core(B)
        for slot in range(B):
            core.start(slot, voice, persona, SamplingParams(seed=slot), seed=slot)
        codes = torch.randint(0, 2048, (B, 8))
        ms = time_ms(lambda: core.step(codes), repeat=20)
        rows.append([f"mid LM tick (tokens only), B={B}", f"{ms:.1f}", f"{ms / BUDGET_MS:.2f}"])
    return rows


def prefill_rows() -> list[list[object]]:
    core, voice, persona = mid_core(4)
    ticks = 1 + voice.embeddings.shape[0] + 12 + len(persona)

    def stepwise() -> None:
        core.start(0, voice, persona, SamplingParams(greedy=True), 0, stepwise=True)
        codes = torch.zeros(4, 8, dtype=torch.long)
        while core.prompts:
            core.step(codes)

    def fast() -> None:
        core.prefix_cache.clear()
        core.start(0, voice, persona, SamplingParams(greedy=True), 0)

    def cached() -> None:
        core.start(0, voice, persona, SamplingParams(greedy=True), 0)

    t = time.perf_counter()
    stepwise()
    step_ms = (time.perf_counter() - t) * 1000
    fast_ms = time_ms(fast, repeat=5, warmup=1)
    cached_ms = time_ms(cached, repeat=20)
    wall = ticks * BUDGET_MS
    return [
        [f"stepwise: {ticks} ticks of the batch (B=4)", f"{step_ms:.0f}", f"{step_ms / BUDGET_MS:.1f}",
         f"{wall:.0f} ms of wall clock at 80 ms per tick"],
        ["fast: one parallel forward of the prompt", f"{fast_ms:.1f}", f"{fast_ms / BUDGET_MS:.2f}", "between two ticks"],
        ["cached: prefix-cache hit, install into the row", f"{cached_ms:.2f}", f"{cached_ms / BUDGET_MS:.3f}",
         "between two ticks"],
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    batches = [1, 4] if a.quick else [1, 4, 16]
    cache = Path(tempfile.gettempdir()) / "personaplex-bench-cache"
    ticks = tiny_ticks(batches, cache) + mid_ticks(batches)
    body = table(["tick", "ms", "fraction of 80 ms"], ticks)
    body += "\n\nPrefill of one caller (mid-size LM, voice T = 50, persona P = 60 tokens):\n\n"
    body += table(["path", "ms", "fraction of 80 ms", "caller waits"], prefill_rows())
    print(body)
    write_section("Engine: tick and prefill", body, "python bench/engine.py" + (" --quick" if a.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
