"""The GPU acceptance run: correctness on the device, then the full-size engine (hash-v1 weights,
bf16 LM, fp32 Mimi, CUDA graphs), in one run of under 8 minutes on one CUDA GPU of any size.

Checks (bench/gpu_checks.py; any failure makes the exit status 1):
- the public golden fixtures in fp32 on the device, token for token (LM sessions stepwise and
  with the fast prefill, a wrapping context, the batched recycle, Mimi streaming);
- CUDA-graph ticks equal to eager ticks over 200 ticks at B = 4 with recycles: tokens and PCM bit
  for bit, and every graph wrapper (LM tick, Mimi encode, Mimi decode) must have captured;
- the same on cuda:1 while cuda:0 is current, when two GPUs are visible (skipped otherwise);
- the bf16 engine on the golden sessions: where it first diverges (reported);
- `--slots auto` on the device: the plan, and an engine of that many slots that runs.
Measures (bench/gpu_batches.py):
- the whole `LockstepEngine.step` (PCM in, Mimi encode, LM tick, Mimi decode, PCM and text out,
  one host transfer) and its parts (LM tick alone, Mimi encode + decode alone) at B = 1, then
  powers of two up to what the free memory holds by `--slots auto`'s arithmetic (64 at most);
  running out of memory at a B is reported, and the run goes on;
- the largest B that stays real time (median tick <= 80 ms): a binary search over B, capped in
  time and bounded by the same fit;
- peak GPU memory per slot, against the `--slots auto` arithmetic.
- last, the same engine with `--weights int8` (bench/gpu_int8.py): the LM quantized in place, the
  tick at B = 1, 16 and 64, the largest real-time B, the weights' bytes, beside the bf16 figures.

The 8.4 B LM weights are hashed straight into bf16 GPU tensors, key by key, by a torch port of
hash-v1 (`personaplex_demo.model.hashinit`) that is checked bit for bit against `make_tensor`
on the smaller keys first; no 17 GB file is written.

    bash bench/gpu.sh                 # on a CUDA machine; writes "## GPU (<device name>)" of BENCHMARKS.md
    bash bench/gpu.sh --section-file /some/dir/gpu.md   # also keep the section as a file
    bash bench/gpu.sh --dry-run --free-gib 24   # anywhere: the same code path on the tiny configs, and
                                                # the batches a card with 24 GiB free would get; writes nothing
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.gpu_batches import (
    FRAME_MS,
    MAX_BATCH,
    BatchPlan,
    Run,
    marginal_per_slot,
    measure_all,
    ms,
    plan_for_card,
    plan_on_device,
    sync,
)
from bench.gpu_int8 import int8_pass, render_int8
from personaplex_demo.model.config import LMConfig, MimiConfig

LM_SEED, MIMI_SEED = 1242, 4347
DRY_RUN_BATCHES, DRY_RUN_SEARCH_MAX = (1, 2, 4), 8  # the tiny configs on a CPU: the code path, quickly
DRY_RUN_FREE_GIB = 80.0  # the card a dry run plans for when --free-gib is not given
M32 = 0xFFFFFFFF


def fail_without_gpu(dry_run: bool) -> None:
    if dry_run or torch.cuda.is_available():
        return
    print(f"bench/gpu.py: no CUDA GPU is visible (torch {torch.__version__}, built for CUDA "
          f"{torch.version.cuda or 'none'}). This benchmark measures the full-size engine on a GPU; "
          "on this machine run `bash bench/gpu.sh --dry-run` to check its code path on the tiny configs.",
          file=sys.stderr)
    sys.exit(2)


# ---- hash-v1 on the device ----------------------------------------------------------------------


def hash_tensor_on(kind: str, key: str, shape: tuple[int, ...], seed: int, device: torch.device,
                   dtype: torch.dtype, chunk: int = 1 << 26) -> torch.Tensor:
    """Exactly `make_tensor(kind, key, shape, seed)` (float32, then cast to dtype), computed on device."""
    from personaplex_demo.engine.sampling import fmix32 as fmix32_tensor
    from personaplex_demo.model.hashinit import fmix32, rule

    offset, scale = rule(kind, key, shape)
    if scale == 0.0:
        return torch.full(shape, offset, dtype=torch.float32, device=device).to(dtype)
    c = int(fmix32(np.uint64(zlib.crc32(key.encode("utf-8"))) ^ fmix32(np.uint64(seed))))
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=device)
    for s in range(0, n, chunk):
        i = torch.arange(s, min(n, s + chunk), device=device, dtype=torch.long)
        h = fmix32_tensor(((i * 0x9E3779B1) & M32) ^ c)
        # The same float64 operations, one kernel each, as the numpy recipe: no fused multiply-add.
        v = h.double().div_(4294967296.0).mul_(2.0).sub_(1.0).mul_(scale)
        if offset != 0.0:
            v = v.add_(offset)
        out[s:s + i.numel()] = v.float().to(dtype)
    return out.view(shape)


def build_hashed(module: torch.nn.Module, kind: str, seed: int, device: torch.device, dtype: torch.dtype,
                 check_below: int = 1 << 20) -> tuple[torch.nn.Module, int]:
    """Assign hash-v1 tensors to a meta-built module; keys up to `check_below` elements are also
    computed by the numpy recipe and must match bit for bit. Returns (module, keys checked)."""
    from tests.support.signals import make_tensor

    state, checked = {}, 0
    for key, t in module.state_dict().items():
        shape = tuple(t.shape)
        want = dtype if t.is_floating_point() else t.dtype
        state[key] = hash_tensor_on(kind, key, shape, seed, device, torch.float32).to(want)
        if math.prod(shape) <= check_below and checked < 40:
            ref = torch.from_numpy(make_tensor(kind, key, shape, seed)).to(want)
            if not torch.equal(state[key].cpu(), ref):
                raise AssertionError(f"device hash-v1 differs from make_tensor on {key}")
            checked += 1
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False), checked


# ---- the engine ---------------------------------------------------------------------------------


class Setup:
    """Everything but the per-B engine: weights, tokenizer, voices."""

    def __init__(self, dry_run: bool, device: torch.device, graphs: bool, workdir: Path):
        from personaplex_demo.model.checkpoint import meta_lm, meta_mimi
        from personaplex_demo.model.config import LMConfig, MimiConfig
        from personaplex_demo.runtime.tiny import build_tiny_tokenizer
        from personaplex_demo.runtime.tokenizer import TextTokenizer
        from personaplex_demo.runtime.voices import VoiceCatalog, write_voices_archive

        self.device, self.graphs, self.dry_run = device, graphs, dry_run
        self.dtype = torch.bfloat16
        self.lm_cfg = LMConfig.tiny() if dry_run else LMConfig()
        self.mimi_cfg = MimiConfig.tiny() if dry_run else MimiConfig()
        t0 = time.perf_counter()
        self.lm, c1 = build_hashed(meta_lm(self.lm_cfg), "lm", LM_SEED, device, self.dtype)
        self.mimi, c2 = build_hashed(meta_mimi(self.mimi_cfg), "mimi", MIMI_SEED, device, torch.float32)
        sync(device)
        self.build_s = time.perf_counter() - t0
        self.checked = c1 + c2
        self.weights_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.lm_params = sum(p.numel() for p in self.lm.parameters())
        self.tokenizer = TextTokenizer(build_tiny_tokenizer(workdir / "tokenizer.model"))
        g = torch.Generator().manual_seed(0)
        self.voice_t = 50
        prompts = {"NATF0": {"embeddings": torch.randn(self.voice_t, 1, 1, self.lm_cfg.dim, generator=g),
                             "cache": torch.randint(0, 2048, (1, 17, 4), generator=g)}}
        self.voices = VoiceCatalog.from_archive(write_voices_archive(workdir / "voices.tgz", prompts),
                                                workdir / "voices")
        self.persona = ("You work for CitySan Services, a waste management company, and your name is "
                        "Ayelen Lucero. You answer calls about missed pickups and billing; be friendly and brief.")

    def engine(self, B: int):
        from personaplex_demo.engine.pcm import LockstepEngine, SamplingParams

        eng = LockstepEngine(self.lm, self.mimi, self.tokenizer, self.voices, B, self.device, self.dtype,
                             cuda_graphs=self.graphs)
        # Every row attends its whole KV ring, as calls past 240 s do: the capacity figures are
        # for a room of long calls (younger calls attend less and are cheaper).
        eng.core.attend_filled = False
        t0 = time.perf_counter()
        for slot in range(B):  # one prefix, computed once and installed B times
            eng.start_session(slot, "NATF0", self.persona, SamplingParams(seed=slot))
        sync(self.device)
        return eng, time.perf_counter() - t0


def plan_run(setup: Setup, a: argparse.Namespace) -> tuple[BatchPlan, tuple[int, ...], int]:
    """(the plan for the card, the batches to measure, the search bound). The dry run plans the
    full-size engine for a card with --free-gib free, by the function the real run uses, and
    measures the tiny configs at B = 1, 2, 4."""
    if a.dry_run:
        plan = plan_for_card(a.free_gib or DRY_RUN_FREE_GIB, LMConfig(), MimiConfig(),
                             setup.dtype, setup.voice_t, setup.graphs)
        return plan, DRY_RUN_BATCHES, DRY_RUN_SEARCH_MAX
    plan = plan_on_device(setup.lm, setup.mimi, setup.device, setup.dtype, setup.weights_bytes, setup.voice_t,
                          setup.graphs, a.free_gib)
    return plan, plan.batches, plan.search_max


@contextmanager
def no_tf32():
    """The golden fixtures are fp32 on a CPU: compare without TF32 matmuls and convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def section_title(device: torch.device) -> str:
    """The BENCHMARKS.md section: one per kind of card, named as the driver names it."""
    if device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"GPU (dry run on {device.type})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny configs, on whatever device exists; writes nothing")
    ap.add_argument("--free-gib", type=float,
                    help="with --dry-run: plan the batches for a card with this much memory free before the weights "
                         f"(default {DRY_RUN_FREE_GIB:g}); on a GPU: use at most this much of what is free")
    ap.add_argument("--no-graphs", action="store_true", help="eager ticks (no CUDA graphs)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--section-file", type=Path, help="also write the markdown section to this file")
    ap.add_argument("--search-seconds", type=float, default=100.0, help="time cap of the largest-B search")
    ap.add_argument("--ticks", type=int, default=30, help="timed ticks per batch size")
    a = ap.parse_args(argv)
    if a.free_gib is not None and not a.free_gib > 0:
        ap.error(f"--free-gib must be a positive number of GiB, not {a.free_gib:g}")
    if a.dry_run:  # the code path, not the numbers: keep it short enough for CI
        a.ticks = min(a.ticks, 8)
    return a


def graph_checks(setup: Setup, dry_run: bool) -> list:
    from bench.gpu_checks import graphs_equal_eager, graphs_on_second_device

    ticks, every = (60, 6) if dry_run else (200, 20)  # calls join and leave: every batch bucket, rows moving
    out = [graphs_equal_eager(setup.lm, setup.mimi, setup.tokenizer, setup.voices, setup.device, setup.dtype,
                              4, ticks, every, setup.persona),
           graphs_on_second_device(setup.lm, setup.mimi, setup.tokenizer, setup.voices, setup.dtype, setup.persona,
                                   ticks=20 if dry_run else 60)]
    report(out)
    return out


def main() -> int:
    a = parse_args()
    fail_without_gpu(a.dry_run)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bench.gpu_checks import goldens_on, slots_auto_on

    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    title = section_title(device)
    print(f"bench/gpu.py: the section \"## {title}\"{' (dry run)' if a.dry_run else ''}", flush=True)
    with no_tf32():
        checks = goldens_on(device)
    report(checks)
    with tempfile.TemporaryDirectory(prefix="pp-gpu-bench-") as tmp:
        setup = Setup(a.dry_run, device, not a.no_graphs, Path(tmp))
        print(f"weights: {setup.lm_params / 1e9:.2f} B LM parameters hashed on {device} in {setup.build_s:.1f} s "
              f"({setup.checked} keys checked against make_tensor)", flush=True)
        checks += graph_checks(setup, a.dry_run)
        plan, batches, max_b = plan_run(setup, a)
        print(f"batches: {plan.describe()}", flush=True)
        if a.dry_run:
            print(f"  (this dry run measures the tiny configs at B = {', '.join(map(str, batches))}, "
                  f"search up to B = {max_b})", flush=True)
        run = measure_all(setup, plan, batches, max_b, a.ticks, 10.0 if a.dry_run else a.search_seconds)
        auto, slot_plan, served = slots_auto_on(setup.lm, setup.mimi, setup.tokenizer, setup.voices, device,
                                                setup.dtype, setup.persona, ticks=3 if a.dry_run else 10)
        checks.append(auto)
        report(checks[-1:])
        int8 = int8_pass(setup, run, a.ticks, 10.0 if a.dry_run else a.search_seconds / 2)  # last: it changes the LM
    body = render(setup, run, time.perf_counter() - t_start, a, checks, slot_plan, served) + "\n\n" + render_int8(int8)
    print("\n" + body)
    write_section(a, title, body)
    failed = [c.name for c in checks if c.ok is False]
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def write_section(a: argparse.Namespace, title: str, body: str) -> None:
    from bench.common import BENCHMARKS_MD, machine, replace_section

    if a.section_file:
        a.section_file.parent.mkdir(parents=True, exist_ok=True)
        a.section_file.write_text(f"## {title}\n\n{body}\n")
        print(f"wrote the section \"## {title}\" to {a.section_file.resolve()}", flush=True)
    if a.dry_run or a.no_write:
        print(f"BENCHMARKS.md left alone ({'--dry-run' if a.dry_run else '--no-write'})", flush=True)
        return
    replace_section(title, body, command=shlex.join(["bash", "bench/gpu.sh", *sys.argv[1:]]), info=machine("cuda"))
    print(f"wrote the section \"## {title}\" of {BENCHMARKS_MD}", flush=True)


def verdict(c, short: bool = False) -> str:
    if c.skipped:
        return "skip" if short else "skipped"
    return ({True: "ok", False: "FAIL", None: "note"} if short else
            {True: "pass", False: "**FAIL**", None: "diagnostic"})[c.ok]


def report(checks) -> None:
    for c in checks:
        print(f"{verdict(c, short=True):>4}  {c.name}: {c.detail}", flush=True)


def render(setup: Setup, run: Run, total_s: float, a: argparse.Namespace, checks, slot_plan, served) -> str:
    from bench.common import md_table

    text = ("### Acceptance checks\n\n"
            + md_table(["check", "result", "detail"], [[c.name, verdict(c), c.detail] for c in checks])
            + "\n\nThe goldens run the fixtures' tiny models in fp32 on the device with TF32 off; the graph checks "
              "and everything below run the full-size engine (hash-v1 weights, bf16 LM, fp32 Mimi).\n\n"
              "### Tick against the batch size\n\n"
            + render_ticks(setup, run, total_s, a.dry_run) + render_memory(run.results, slot_plan, served))
    if a.dry_run:
        text = "_Dry run on the tiny configs; these numbers say nothing about a GPU._\n\n" + text
    return text


def render_ticks(setup: Setup, run: Run, total_s: float, dry_run: bool) -> str:
    from bench.common import md_table

    rows = []
    for r in run.results:
        peak = r.get("peak_per_slot")
        rows.append([r["B"], f"{ms(r['tick']):.1f}", f"{ms(r['tick'], 99):.1f}", f"{ms(r['tick']) / FRAME_MS:.2f}",
                     f"{ms(r['lm']):.1f}", f"{ms(r['mimi']):.1f}",
                     f"{peak / 2**20:.0f}" if peak else "n/a", f"{r['start_s'] * 1000:.0f}", r["graphs"]])
    search = f"**{run.lo}**" + (f" (B = {run.hi} is not)" if run.hi <= run.max_b else "") + f"; search: {run.why}"
    measured = ", ".join(map(str, run.batches))
    lines = [f"Largest B in real time (median engine tick <= 80 ms): {search}, up to B = {run.max_b}.",
             f"Batches from the free memory by `--slots auto`'s arithmetic (1, then powers of two up to the fit, "
             f"{MAX_BATCH} at most; the search bounded by the fit): {run.plan.describe()}."
             + (f" This dry run measured the tiny configs at B = {measured}." if dry_run else ""),
             *(n[:1].upper() + n[1:] + "." for n in run.notes)]
    if run.results:
        last = run.results[-1]
        lines.append(f"Mimi encode + decode at B = {last['B']}: {ms(last['mimi']):.1f} ms per frame (fp32, CUDA "
                     f"graphs {'on' if setup.graphs and setup.device.type == 'cuda' else 'off'}).")
    lines += [f"LM {setup.lm_params / 1e9:.2f} B parameters, hash-v1 weights hashed on {setup.device.type} in "
              f"{setup.build_s:.1f} s ({setup.checked} keys checked bit for bit against `make_tensor`); voice T = "
              f"{setup.voice_t}, sampling with the served defaults; every row attends its whole KV ring (the cost "
              f"of calls past 240 s; younger calls attend only the filled part); whole run {total_s:.0f} s.",
              "Targets: tick <= 15 ms at 1 slot, <= 45 ms at 64 slots, 64 or more callers in real time."]
    return (md_table(["B", "engine tick ms (median)", "p99 ms", "fraction of 80 ms", "LM tick ms", "Mimi enc+dec ms",
                      "peak MiB per slot", "start B sessions ms", "CUDA graph"], rows)
            + "\n\n" + "\n".join(f"- {line}" for line in lines) + "\n\n")


def render_memory(results: list[dict], plan, served) -> str:
    marginal = marginal_per_slot(results)
    c = plan.cost
    measured = (f"{marginal / 2**20:.0f} MiB measured (the growth of the peak from B = {results[0]['B']} to "
                f"{results[-1]['B']}, one tick graph per top-k: whole rings)" if marginal else
                "not measured (no CUDA allocator here, or fewer than two batches ran)")
    return ("### Memory per slot and `--slots auto`\n\n"
            + f"- Per slot: {measured}, against {c.total / 2**20:.0f} MiB in the arithmetic (KV "
              f"{c.kv / 2**20:.0f} MiB, Mimi {c.mimi / 2**20:.0f} MiB, activations {c.activations / 2**20:.0f} MiB "
              "for every tick graph the engine may keep).\n"
            + f"- `--slots auto` here: {served.describe()}.\n"
            + f"- Without the cap: {plan.describe()}; the check above ran that many.")


if __name__ == "__main__":
    sys.exit(main())
