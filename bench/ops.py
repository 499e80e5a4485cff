"""Operators per engine tick at the real model's layer counts, and the CPU tick time beside them.

On a GPU each operator is at least one kernel launch (2-3 us even replayed from a CUDA graph);
on the CPU each is a dispatch through the PyTorch stack. Their number, not the arithmetic, is
what a tick at small widths costs, so it is counted here with a `TorchDispatchMode` that sees
every ATen operator the tick runs:

- the model: the temporal transformer's 32 layers and the depformer's 6 (8 steps of them per
  frame), Mimi's 8 + 8 transformer layers and its full SEANet, all at the tiny widths (the count
  does not depend on the width);
- one `LockstepEngine.step` (PCM in -> Mimi encode -> LM tick -> Mimi decode -> PCM out) with
  every slot live and sampling with the served defaults, split into its three parts;
- "kernels" leaves out the operators that only make a view (no data moves).

    .venv/bin/python bench/ops.py [--batch 4] [--label now] [--no-write]

`--label` names the column this run fills in BENCHMARKS.md's table, so that a before and an after
run of the same host stand side by side.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import REPO, LoadWatch, Stats, fmt_ms, machine, md_table, replace_section
from bench.engines import build_engine
from personaplex_demo.engine.pcm import LockstepEngine, SamplingParams
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.model.lm import PersonaPlexLM
from personaplex_demo.model.mimi import Mimi
from personaplex_demo.model.transformer import RMSNorm

SECTION = "Operators per engine tick"
RESULTS = REPO / "bench" / "ops-results.json"  # the columns of earlier runs (label -> figures)
PERSONA = "You are a friendly assistant; answer briefly."


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while active, by name, and separately those run
    inside an RMSNorm (see `count_norms`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.norm_calls = 0
        self.norm_ops = 0
        self._in_norm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if self._in_norm and not _is_view(name):
            self.norm_ops += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every dispatch, views included."""
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Operators that run a kernel (views left out)."""
        return sum(n for name, n in self.ops.items() if not _is_view(name))

    @property
    def cuda_kernels(self) -> int:
        """The same tick on CUDA, where each RMSNorm is the one fused kernel it dispatches there
        (where this code's RMSNorm takes `F.rms_norm` on CUDA; earlier code ran its formula)."""
        if "rms_norm" not in inspect.getsource(RMSNorm.forward):
            return self.kernels
        return self.kernels - self.norm_ops + self.norm_calls

    @contextmanager
    def count_norms(self, model: torch.nn.Module):
        """Attribute to `norm_ops` what each RMSNorm of `model` runs, and count the calls."""
        def enter(module, args):
            self._in_norm += 1
            self.norm_calls += 1

        def leave(module, args, out):
            self._in_norm -= 1

        hooks = []
        for m in model.modules():
            if isinstance(m, RMSNorm):
                hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()


_VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "permute", "transpose", "t", "expand",
          "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes",
          "chunk", "narrow", "view_as_real", "view_as_complex", "_reshape_alias", "unfold", "lift_fresh"}


def _is_view(name: str) -> bool:
    return name in _VIEWS


def real_layer_configs() -> tuple[LMConfig, MimiConfig]:
    """The real model's layer counts and structure at the tiny widths."""
    lm = replace(LMConfig.tiny(), num_layers=LMConfig().num_layers, depformer_num_layers=LMConfig().depformer_num_layers)
    real = MimiConfig()
    mimi = replace(MimiConfig.tiny(), transformer_num_layers=real.transformer_num_layers,
                   quantizer_n_q=real.quantizer_n_q)
    return lm, mimi


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def engine_at_real_layer_counts(batch: int) -> LockstepEngine:
    """A `LockstepEngine` of `batch` live slots over the real layer counts; the tiny runtime
    lends its tokenizer and voices (whose width matches)."""
    tiny = build_engine("tiny", slots=1)
    lm_cfg, mimi_cfg = real_layer_configs()
    engine = LockstepEngine(_init(PersonaPlexLM(lm_cfg), 1), _init(Mimi(mimi_cfg), 2), tiny.tokenizer, tiny.voices,
                            batch)
    for slot in range(batch):
        engine.start_session(slot, engine.voice_names[slot % len(engine.voice_names)], PERSONA,
                             SamplingParams(seed=slot))
    return engine


def count_tick(engine: LockstepEngine, pcm: np.ndarray) -> dict[str, OpCounter]:
    """Operators of one `engine.step(pcm)` and of its three parts, each counted on its own."""
    parts = {"mimi encode": engine._encode, "mimi decode": engine._decode}
    counters = {name: OpCounter() for name in ("tick", "mimi encode", "LM tick", "mimi decode")}
    originals = {name: (getattr(fn, "fn", fn)) for name, fn in parts.items()}
    core_step = engine.core.step

    def counted(name, fn):
        def run(*args, **kwargs):
            with counters[name]:
                return fn(*args, **kwargs)
        return run

    engine._encode = counted("mimi encode", originals["mimi encode"])
    engine._decode = counted("mimi decode", originals["mimi decode"])
    engine.core.step = counted("LM tick", core_step)
    try:
        with counters["tick"], counters["tick"].count_norms(engine.core.lm):
            engine.step(pcm)
    finally:
        engine._encode, engine._decode = parts["mimi encode"], parts["mimi decode"]
        del engine.core.step
    return counters


def tick_time(engine: LockstepEngine, pcm: np.ndarray, seconds: float) -> Stats:
    stats = Stats()
    for _ in range(3):
        engine.step(pcm)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or stats.n < 10:
        t0 = time.perf_counter()
        engine.step(pcm)
        stats.samples.append(time.perf_counter() - t0)
    return stats


def served_tiny_engine(batch: int) -> LockstepEngine:
    """The tiny model as the app serves it (2 temporal layers), every slot live."""
    engine = build_engine("tiny", slots=batch)
    for slot in range(batch):
        engine.start_session(slot, engine.voice_names[slot % len(engine.voice_names)], PERSONA,
                             SamplingParams(seed=slot))
    return engine


def measure(batch: int, seconds: float) -> dict:
    engine = engine_at_real_layer_counts(batch)
    pcm = (0.1 * np.sin(np.arange(batch * 1920) / 9.0)).astype(np.float32).reshape(batch, 1920)
    for _ in range(3):  # past the warm-up steps of the delays, so every row emits
        engine.step(pcm)
    counters = count_tick(engine, pcm)
    stats = tick_time(engine, pcm, seconds)
    tiny = tick_time(served_tiny_engine(batch), pcm, seconds)
    top = counters["tick"].ops.most_common(12)
    tick = counters["tick"]
    return {"batch": batch,
            "dispatches": {name: c.total for name, c in counters.items()},
            "operators": {name: c.kernels for name, c in counters.items()},
            "norms": [tick.norm_calls, tick.norm_ops], "cuda_operators": tick.cuda_kernels,
            "tick_ms": stats.median * 1000, "tick_p90_ms": stats.pct(90) * 1000, "ticks": stats.n,
            "tiny_ms": tiny.median * 1000, "tiny_p90_ms": tiny.pct(90) * 1000,
            "top": top}


def report(results: dict[str, dict], batch: int) -> str:
    labels = list(results)
    rows = [[f"operators: {part}"] + [results[k]["operators"][part] for k in labels]
            for part in ("tick", "mimi encode", "LM tick", "mimi decode")]
    rows.append(["&nbsp;&nbsp;of which in RMSNorms (calls x operators)"] +
                [f"{results[k]['norms'][0]} x {results[k]['norms'][1] / max(results[k]['norms'][0], 1):.0f} = "
                 f"{results[k]['norms'][1]}" for k in labels])
    rows.append(["**operators on CUDA**: the tick with each RMSNorm one kernel"] +
                [f"**{results[k]['cuda_operators']}**" for k in labels])
    rows.append(["dispatches, views included: tick"] + [results[k]["dispatches"]["tick"] for k in labels])
    rows.append(["CPU tick, median ms (p90)"] + [f"{fmt_ms(results[k]['tick_ms'] / 1000)} "
                                                  f"({fmt_ms(results[k]['tick_p90_ms'] / 1000)})" for k in labels])
    rows.append(["CPU tick of the served tiny model (2 layers), median ms (p90)"] +
                [f"{fmt_ms(results[k]['tiny_ms'] / 1000)} ({fmt_ms(results[k]['tiny_p90_ms'] / 1000)})"
                 for k in labels])
    rows.append(["measured"] + [results[k]["when"] for k in labels])
    last = results[labels[-1]]
    top = ", ".join(f"{name} {n}" for name, n in last["top"] if not _is_view(name))
    return (md_table(["one `LockstepEngine.step`, B = " + str(batch)] + labels, rows)
            + f"\n\nLM: {LMConfig().num_layers} temporal layers, {LMConfig().depformer_num_layers} depformer layers "
              f"(8 steps per frame), Mimi {MimiConfig().transformer_num_layers} + "
              f"{MimiConfig().transformer_num_layers} transformer layers and its SEANet, all at the tiny "
              "widths; every slot live, sampling with the served defaults. An operator is an ATen operator "
              "that runs a kernel, counted by a `TorchDispatchMode` (views are counted apart). On the CPU "
              "an RMSNorm is the reference's formula, six operators, kept for bit-exact tokens; on CUDA it "
              "is `torch.nn.functional.rms_norm`, which dispatches one fused kernel there: the CUDA row is "
              "the measured count with each measured RMSNorm call counted once. The CPU tick is that "
              "engine's, fp32, on this host. Most frequent operators in the last column: " + top + ".")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--label", default="now", help="the column of the table this run fills")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long to time the tick")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    info = machine()
    watch = LoadWatch()
    torch.manual_seed(0)
    with torch.no_grad():
        res = measure(a.batch, a.seconds)
    res["when"] = f"{datetime.date.today()}, {info['cpu']}, commit {commit()}"
    print(json.dumps({k: v for k, v in res.items() if k != "top"}, indent=1))
    print("top:", res["top"])
    if a.no_write:
        return 0
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[a.label] = res
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    replace_section(SECTION, report(results, a.batch) + f"\n\nCPU load during the last run: {watch.summary()}.",
                    info=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
