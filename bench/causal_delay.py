"""The engine's own causal delay: how soon a change in what a caller says can change what they hear.

On the lockstep engine as the app runs it (Mimi encoder, the LM's temporal and depth transformers,
Mimi decoder, greedy decoding so that only the input differs), one call is replayed twice: once
with a reference input, once with input frame `t` replaced. The first output sample that differs
says when the model can first answer that frame: the step, and the sample within the step's
output frame. The app's round-trip floor is built from it (docs/engine.md § Causal delay), and the
loopback engine of bench/loopback_app.py answers with exactly this delay.

The tiny model runs the whole PCM path; `--mid` adds the same measurement on the tokens of a
mid-size LM (bench/engines.py), whose step order is the real model's.

    python bench/causal_delay.py [--trials 12] [--mid] [--write]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import md_table, replace_section  # noqa: E402

log = logging.getLogger("bench.causal_delay")
SECTION = "The engine's causal delay"


def replay(engine, frames: np.ndarray) -> np.ndarray:
    """Row 0's output samples for `frames` [T, frame] after a fresh greedy session's prompt."""
    from personaplex_demo.call_settings import SamplingParams

    engine.start_session(0, "NATF2", "", SamplingParams(seed=1, greedy=True))
    idle = np.zeros((engine.batch_size, engine.frame_size), np.float32)
    while not engine.core.is_live(0):  # the prompt plays first
        engine.step(idle)
    out = []
    for frame in frames:
        pcm = idle.copy()
        pcm[0] = frame
        out.append(np.asarray(engine.step(pcm).pcm[0]).copy())
    engine.end_session(0)
    return np.concatenate(out)


def first_change(engine, frames: np.ndarray, t: int, seed: int) -> tuple[int, int] | None:
    """(steps after `t`, sample within that step's output frame) of the first output sample that
    changes when input frame `t` is replaced by other noise; None if nothing changed."""
    changed = frames.copy()
    changed[t] = np.random.default_rng(seed).standard_normal(frames.shape[1]).astype(np.float32) * 0.3
    a, b = replay(engine, frames), replay(engine, changed)
    diff = np.flatnonzero(a != b)
    if not diff.size:
        return None
    return int(diff[0] // engine.frame_size - t), int(diff[0] % engine.frame_size)


def pcm_delays(engine, trials: int) -> list[tuple[int, int] | None]:
    rng = np.random.default_rng(0)
    frames = (rng.standard_normal((12, engine.frame_size)) * 0.1).astype(np.float32)
    return [first_change(engine, frames, 3 + k % 6, seed=k) for k in range(trials)]


def token_delays(trials: int) -> list[int | None]:
    """Steps from a changed user frame (its 8 codes) to the first changed agent token, mid LM."""
    import torch

    from bench.engines import mid_lm_config
    from bench.model import LM_SEED, bench_persona, bench_voice, hash_file
    from personaplex_demo.call_settings import SamplingParams
    from personaplex_demo.engine.core import LockstepCore
    from personaplex_demo.model.checkpoint import load_lm, meta_lm

    cfg = mid_lm_config()
    lm = load_lm(cfg, hash_file("lm", "lm-mid", lambda: meta_lm(cfg), LM_SEED))
    voice, persona = bench_voice(cfg, 10), bench_persona(10)
    g = torch.Generator().manual_seed(1)
    user = [torch.randint(0, 2048, (1, 8), generator=g) for _ in range(12)]

    def run(codes) -> list:
        core = LockstepCore(lm, 1)
        core.start(0, voice, persona, SamplingParams(seed=1, greedy=True), seed=1)
        return [core.step(c).frame[:, :9].clone() for c in codes]  # text and the agent's 8 codebooks

    found = []
    with torch.no_grad():
        ref = run(user)
        for k in range(trials):
            t = 3 + k % 6
            changed = list(user)
            changed[t] = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(100 + k))
            out = run(changed)
            steps = [s - t for s, (x, y) in enumerate(zip(ref, out, strict=True)) if not torch.equal(x, y)]
            found.append(steps[0] if steps else None)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--mid", action="store_true", help="also the mid-size LM, on tokens")
    ap.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from bench.engines import build_engine

    with tempfile.TemporaryDirectory(prefix="causal-") as tmp:
        found = pcm_delays(build_engine("tiny", slots=2, cache_dir=Path(tmp)), a.trials)
    rows = [["tiny, PCM in and out", a.trials, _summary([f[0] if f else None for f in found]),
             _summary([f[1] if f else None for f in found])]]
    if a.mid:
        rows.append(["mid LM (8 + 4 layers), the agent's tokens", a.trials, _summary(token_delays(a.trials)), "-"])
    body = md_table(["engine", "trials", "steps until the output changes", "first changed sample in that frame"],
                    rows)
    print(body)
    if a.write:
        replace_section(SECTION, body + "\n")
    return 0


def _summary(values: list[int | None]) -> str:
    """"1 (11 trials), 2 (1)": each value seen and in how many trials (greedy decoding can pick
    the same tokens for a different input, so a later step is the first change in some)."""
    seen = sorted({v for v in values if v is not None})
    missing = sum(v is None for v in values)
    counts = [f"{v} ({values.count(v)}{' trials' if k == 0 else ''})" for k, v in enumerate(seen)]
    return ", ".join(counts) + (f", unchanged ({missing})" if missing else "")


if __name__ == "__main__":
    sys.exit(main())
