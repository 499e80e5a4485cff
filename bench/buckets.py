"""Ticks sized by the live calls: tick time against live calls for rooms of 1, 4 and 12 slots,
stepping every slot (as every tick did before batch buckets) and stepping the batch bucket that
holds the live calls, side by side in one run (docs/engine.md § Ticks sized by the live calls).

- tiny: the full `LockstepEngine.step` of the tiny model (Mimi encode, LM tick, Mimi decode,
  transcript), live calls started with a voice and a persona, speech-like audio in;
- mid-deep: the tokens-only `LockstepCore.step` of a mid-width LM at the real model's layer counts
  (32 temporal, 6 depformer layers; width 512), as a CPU stand-in for what each idle row costs a
  real tick.

"Every slot" is the same engine told that its only bucket is the slot count (its rows never
move), so both columns step the same calls on the same machine, interleaved round by round.

    python bench/buckets.py [--rounds 60] [--write]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import Stats, interleave, md_table, publish  # noqa: E402
from bench.engine import PERSONA, speech_like  # noqa: E402
from bench.engines import build_engine  # noqa: E402
from bench.model import LM_SEED, bench_cache, bench_persona, bench_voice, hash_file  # noqa: E402
from personaplex_demo.engine.core import LockstepCore  # noqa: E402
from personaplex_demo.engine.pcm import SamplingParams  # noqa: E402
from personaplex_demo.engine.rows import batch_bucket  # noqa: E402
from personaplex_demo.model.checkpoint import load_lm, meta_lm  # noqa: E402
from personaplex_demo.model.config import LMConfig  # noqa: E402

log = logging.getLogger("bench.buckets")
SECTION = "Ticks sized by the live calls"
ROOMS = {1: [1], 4: [1, 2, 4], 12: [1, 2, 4, 8, 12]}  # slots: live calls


def mid_deep_config() -> LMConfig:
    """Mid width (bench/engines.py `mid_lm_config`) at the real model's 32 + 6 layers."""
    return LMConfig(dim=512, num_heads=8, num_layers=32, depformer_dim=256, depformer_num_heads=4,
                    depformer_num_layers=6, depformer_dim_feedforward=int(4.125 * 256))


def tiny_cases(slots: int, live: int) -> dict[str, Callable[[], None]]:
    engine = build_engine("tiny", slots=slots, cache_dir=bench_cache())
    for slot in range(live):
        engine.start_session(slot, engine.voice_names[slot % len(engine.voice_names)], PERSONA,
                             SamplingParams(seed=slot))
    audio = speech_like(np.random.default_rng(live), slots, 25)
    pos, buckets = [0], list(engine.core.buckets)

    def step(every_slot: bool) -> None:
        engine.core.buckets = [slots] if every_slot else buckets
        engine.step(audio[pos[0] % len(audio)])
        pos[0] += 1

    return {"every slot": lambda: step(True), "buckets": lambda: step(False)}


def core_cases(core: LockstepCore, live: int) -> dict[str, Callable[[], None]]:
    """`live` calls in the lowest rows of `core` (whose every row was started), the others idle."""
    g = torch.Generator().manual_seed(live)
    user = [torch.randint(0, 2048, (core.B, 8), generator=g) for _ in range(16)]
    pos = [0]

    def step(rows: int) -> None:
        for row in range(core.B):
            core.set_live(row, row < live)
        core.step(user[pos[0] % len(user)][:rows])
        pos[0] += 1

    return {"every slot": lambda: step(core.B), "buckets": lambda: step(batch_bucket(live, core.buckets))}


def measure_room(model: str, slots: int, rounds: int, lm=None) -> list[list]:
    rows = []
    core = None
    if lm is not None:
        core = LockstepCore(lm, slots, context=512)
        voice, persona = bench_voice(lm.cfg), bench_persona()
        for row in range(slots):
            core.start(row, voice, persona, SamplingParams(seed=row), seed=row)
    for live in ROOMS[slots]:
        cases = tiny_cases(slots, live) if core is None else core_cases(core, live)
        with torch.no_grad():
            stats: dict[str, Stats] = interleave(cases, rounds=rounds, per_round=1, warmup=3)
        every, bucketed = stats["every slot"], stats["buckets"]
        batch = batch_bucket(live, [*ROOMS[slots], slots])
        rows.append([model, slots, live, batch, f"{every.ms():.1f}/{every.ms(99):.1f}",
                     f"{bucketed.ms():.1f}/{bucketed.ms(99):.1f}", f"{bucketed.median / every.median:.2f}"])
        log.info("%s", rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="ticks of each case")
    ap.add_argument("--models", nargs="+", default=["tiny", "mid-deep"], choices=["tiny", "mid-deep"])
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    table_rows: list[list] = []
    for model in a.models:
        lm = None
        if model == "mid-deep":
            cfg = mid_deep_config()
            lm = load_lm(cfg, hash_file("lm", "lm-mid-deep", lambda: meta_lm(cfg), LM_SEED))
        for slots in ROOMS:
            table_rows += measure_room(model, slots, a.rounds, lm)
    one = {r[1]: r for r in table_rows if r[0] == "tiny" and r[2] == 1}
    body = md_table(["model", "slots", "live calls", "batch stepped", "every slot: tick p50/p99 (ms)",
                     "buckets: tick p50/p99 (ms)", "buckets / every slot (p50)"], table_rows)
    if 1 in one and 12 in one:
        p50 = {s: float(one[s][5].split("/")[0]) for s in (1, 12)}
        body += (f"\n\nOne caller, tiny model: {p50[12]:.1f} ms a tick in a 12-slot room against {p50[1]:.1f} ms in "
                 f"a 1-slot room ({p50[12] / p50[1]:.2f}x); stepping every slot it was "
                 f"{float(one[12][4].split('/')[0]):.1f} ms.")
    publish(SECTION, body, a.write)


if __name__ == "__main__":
    main()
