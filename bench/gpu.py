"""The GPU acceptance run: correctness on the device, then the full-size engine (hash-v1 weights,
bf16 LM, fp32 Mimi, CUDA graphs), in one run of under 8 minutes on one GPU.

Checks (bench/gpu_checks.py; any failure makes the exit status 1):
- the public golden fixtures in fp32 on the device, token for token (LM sessions stepwise and
  with the fast prefill, a wrapping context, the batched recycle, Mimi streaming);
- CUDA-graph ticks equal to eager ticks over 200 ticks at B = 4 with recycles;
- the bf16 engine on the golden sessions: where it first diverges (reported);
- `--slots auto` on the device: the plan, and an engine of that many slots that runs.
Measures:
- the whole `LockstepEngine.step` (PCM in, Mimi encode, LM tick, Mimi decode, PCM and text out,
  one host transfer) at B = 1, 16, 64, and its parts (LM tick alone, Mimi encode + decode alone);
- the largest B that stays real time (median tick <= 80 ms): a binary search over B, capped in
  time and by GPU memory;
- peak GPU memory per slot, against the `--slots auto` arithmetic.

The 8.4 B LM weights are hashed straight into bf16 GPU tensors, key by key, by a torch port of
hash-v1 (`personaplex_demo.model.hashinit`) that is checked bit for bit against `make_tensor`
on the smaller keys first; no 17 GB file is written.

    bash bench/gpu.sh                 # on a CUDA machine; writes "## GPU (H200)" of BENCHMARKS.md
    bash bench/gpu.sh --section-file /some/dir/gpu.md   # also keep the section as a file
    bash bench/gpu.sh --dry-run       # anywhere: the same code path on the tiny configs, writes nothing
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

SECTION = "GPU (H200)"
LM_SEED, MIMI_SEED = 1242, 4347
FRAME_MS = 80.0
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
    from personaplex_demo.model.hashinit import make_tensor

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, n: int, device: torch.device, warmup: int = 3) -> list[float]:
    for _ in range(warmup):  # eager, then capture, then a replay
        fn()
    sync(device)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def ms(samples: list[float], q: float = 50) -> float:
    return 1000.0 * float(np.percentile(samples, q))


class Setup:
    """Everything but the per-B engine: weights, tokenizer, voices."""

    def __init__(self, dry_run: bool, device: torch.device, graphs: bool, workdir: Path):
        from personaplex_demo.model.checkpoint import meta_lm, meta_mimi
        from personaplex_demo.model.config import LMConfig, MimiConfig
        from personaplex_demo.runtime.tokenizer import TextTokenizer, build_tiny_tokenizer
        from personaplex_demo.runtime.voices import VoiceCatalog, write_voices_archive

        self.device, self.graphs, self.dry_run = device, graphs, dry_run
        self.dtype = torch.bfloat16
        self.lm_cfg = LMConfig.tiny() if dry_run else LMConfig.personaplex_7b()
        self.mimi_cfg = MimiConfig.tiny() if dry_run else MimiConfig.personaplex()
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

    def kv_bytes_per_slot(self) -> int:
        c = self.lm_cfg
        return 2 * c.num_layers * c.num_heads * c.context * c.head_dim * torch.finfo(self.dtype).bits // 8

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


def measure_b(setup: Setup, B: int, n: int, parts: bool) -> dict:
    """Engine tick at B (and, with `parts`, the LM tick and Mimi alone); peak memory."""
    from personaplex_demo.engine.cuda_graphs import CudaGraphed

    dev = setup.device
    if dev.type == "cuda":
        gc.collect()  # the last engine refers to itself through its graph wrappers
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    eng, start_s = setup.engine(B)
    rng = np.random.default_rng(B)
    pcm = (0.1 * rng.standard_normal((8, B, 1920))).astype(np.float32)
    pos = [0]

    def tick() -> None:
        eng.step(pcm[pos[0] % 8])
        pos[0] += 1

    with torch.no_grad():
        res = {"B": B, "tick": timed(tick, n, dev), "start_s": start_s}
        graphed = getattr(getattr(eng.core, "_graphed_live_tick", None), "_graphs", None)
        res["graphs"] = bool(graphed) if graphed is not None else None
        if parts:
            codes = torch.randint(0, 2048, (B, 8), device=dev)
            res["lm"] = timed(lambda: eng.core.step(codes), n, dev)
            state = setup.mimi.init_state(B, device=dev)
            enc = CudaGraphed(lambda x: setup.mimi.encode_step(x, state), "bench mimi encode", setup.graphs)
            dec = CudaGraphed(lambda c: setup.mimi.decode_step(c, state), "bench mimi decode", setup.graphs)
            x = torch.from_numpy(pcm[0]).to(dev)
            res["mimi"] = timed(lambda: dec(enc(x)), n, dev)
    if dev.type == "cuda":
        sync(dev)
        res["peak_per_slot"] = (torch.cuda.max_memory_allocated(dev) - setup.weights_bytes) / B
    return res  # the engine, its KV cache and its graphs are freed here


def largest_realtime(setup: Setup, known: dict[int, float], cap_s: float, max_b: int, n: int) -> tuple[int, int, str]:
    """Binary search for the largest B whose median engine tick is <= 80 ms.
    Returns (largest real-time B found, smallest B known not to be, how the search ended)."""
    ok = [b for b, t in known.items() if t <= FRAME_MS]
    bad = [b for b, t in known.items() if t > FRAME_MS]
    lo = max(ok) if ok else 0
    hi = min(bad) if bad else max_b + 1
    deadline = time.monotonic() + cap_s
    why = "exact"
    while hi - lo > 1:
        if time.monotonic() > deadline:
            why = f"time cap of {cap_s:.0f} s reached"
            break
        mid = (lo + hi) // 2
        try:
            t = ms(measure_b(setup, mid, n, parts=False)["tick"])
        except torch.cuda.OutOfMemoryError:
            t = math.inf
            max_b = min(max_b, mid - 1)
        print(f"  search: B={mid}: {t:.1f} ms", flush=True)
        if t <= FRAME_MS:
            lo = mid
        else:
            hi = mid
    if hi == max_b + 1 and lo == max_b:
        why = "memory bound (no larger B fits on the GPU)"
    return lo, hi, why


@contextmanager
def no_tf32():
    """The golden fixtures are fp32 on a CPU: compare without TF32 matmuls and convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def marginal_per_slot(results: list[dict]) -> float | None:
    """Device bytes one more slot costs: the growth of the peak between the smallest and the largest B."""
    peaks = [(r["B"], r["peak_per_slot"] * r["B"]) for r in results if r.get("peak_per_slot")]
    if len(peaks) < 2:
        return None
    (b0, p0), (b1, p1) = peaks[0], peaks[-1]
    return (p1 - p0) / (b1 - b0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny configs, on whatever device exists; writes nothing")
    ap.add_argument("--no-graphs", action="store_true", help="eager ticks (no CUDA graphs)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--section-file", type=Path, help="also write the markdown section to this file")
    ap.add_argument("--search-seconds", type=float, default=100.0, help="time cap of the largest-B search")
    ap.add_argument("--ticks", type=int, default=30, help="timed ticks per batch size")
    a = ap.parse_args()
    fail_without_gpu(a.dry_run)
    if a.dry_run:  # the code path, not the numbers: keep it short enough for CI
        a.ticks = min(a.ticks, 8)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bench.gpu_checks import goldens_on, graphs_equal_eager, slots_auto_on

    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = (1, 2, 4) if a.dry_run else (1, 16, 64)
    with no_tf32():
        checks = goldens_on(device)
    report(checks)
    with tempfile.TemporaryDirectory(prefix="pp-gpu-bench-") as tmp:
        setup = Setup(a.dry_run, device, not a.no_graphs, Path(tmp))
        print(f"weights: {setup.lm_params / 1e9:.2f} B LM parameters hashed on {device} in {setup.build_s:.1f} s "
              f"({setup.checked} keys checked against make_tensor)", flush=True)
        ticks, every = (40, 10) if a.dry_run else (200, 50)
        checks.append(graphs_equal_eager(setup.lm, setup.mimi, setup.tokenizer, setup.voices, device, setup.dtype,
                                         4, ticks, every, setup.persona))
        report(checks[-1:])
        results = []
        for B in batches:
            r = measure_b(setup, B, a.ticks if B < 64 else max(10, a.ticks * 2 // 3), parts=True)
            results.append(r)
            print(f"B={B}: tick {ms(r['tick']):.1f} ms, LM {ms(r['lm']):.1f} ms, Mimi {ms(r['mimi']):.1f} ms", flush=True)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            per_slot = results[-1].get("peak_per_slot") or setup.kv_bytes_per_slot()
            max_b = int((total - setup.weights_bytes - (4 << 30)) // per_slot)
        else:
            max_b = 8
        known = {r["B"]: ms(r["tick"]) for r in results}
        lo, hi, why = largest_realtime(setup, known, 10.0 if a.dry_run else a.search_seconds, max_b, 10)
        auto, plan, served = slots_auto_on(setup.lm, setup.mimi, setup.tokenizer, setup.voices, device, setup.dtype,
                                           setup.persona, ticks=3 if a.dry_run else 10)
        checks.append(auto)
        report(checks[-1:])
    body = render(setup, results, lo, hi, why, max_b, time.perf_counter() - t_start, a, checks, plan, served)
    print("\n" + body)
    if a.section_file:
        a.section_file.write_text(f"## {SECTION}\n\n{body}\n")
    if not (a.dry_run or a.no_write):
        from bench.common import machine, replace_section

        replace_section(SECTION, body, command="bash bench/gpu.sh", info=machine("cuda"))
    failed = [c.name for c in checks if c.ok is False]
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def report(checks) -> None:
    for c in checks:
        print(f"{ {True: 'ok', False: 'FAIL', None: 'note'}[c.ok]:>4}  {c.name}: {c.detail}", flush=True)


def render(setup: Setup, results: list[dict], lo: int, hi: int, why: str, max_b: int, total_s: float, a,
           checks, plan, served) -> str:
    from bench.common import md_table

    verdict = {True: "pass", False: "**FAIL**", None: "diagnostic"}
    text = ("### Acceptance checks\n\n"
            + md_table(["check", "result", "detail"], [[c.name, verdict[c.ok], c.detail] for c in checks])
            + "\n\nThe goldens run the fixtures' tiny models in fp32 on the device with TF32 off; the graph check "
              "and everything below run the full-size engine (hash-v1 weights, bf16 LM, fp32 Mimi).\n\n"
              "### Tick against the batch size\n\n")
    rows = []
    for r in results:
        peak = r.get("peak_per_slot")
        rows.append([r["B"], f"{ms(r['tick']):.1f}", f"{ms(r['tick'], 99):.1f}", f"{ms(r['tick']) / FRAME_MS:.2f}",
                     f"{ms(r['lm']):.1f}", f"{ms(r['mimi']):.1f}",
                     f"{peak / 2**20:.0f}" if peak else "n/a", f"{r['start_s'] * 1000:.0f}",
                     {True: "yes", False: "no (eager)", None: "?"}[r["graphs"]]])
    cfg = setup.lm_cfg
    search = f"**{lo}**" + (f" (B = {hi} is not)" if hi <= max_b else "") + f"; search: {why}"
    text += (md_table(["B", "engine tick ms (median)", "p99 ms", "fraction of 80 ms", "LM tick ms", "Mimi enc+dec ms",
                       "peak MiB per slot", "start B sessions ms", "CUDA graph"], rows)
             + f"\n\n- Largest B in real time (median engine tick <= 80 ms): {search}. Memory allows about "
               f"{max_b} slots ({setup.kv_bytes_per_slot() / 2**20:.0f} MiB of temporal KV per slot: "
               f"{cfg.num_layers} layers x {cfg.context} frames x {cfg.dim} x 2 in bf16).\n"
             + f"- Mimi encode + decode at B = {results[-1]['B']}: {ms(results[-1]['mimi']):.1f} ms per frame "
               f"(fp32, CUDA graphs {'on' if setup.graphs and setup.device.type == 'cuda' else 'off'}).\n"
             + f"- LM {setup.lm_params / 1e9:.2f} B parameters, hash-v1 weights hashed on "
               f"{setup.device.type} in {setup.build_s:.1f} s ({setup.checked} keys checked bit for bit against "
               "`make_tensor`); "
               f"voice T = {setup.voice_t}, sampling with the served defaults; every row attends its whole "
               f"KV ring (the cost of calls past 240 s; younger calls attend only the filled part); "
               f"whole run {total_s:.0f} s.\n"
             + "- Targets: tick <= 15 ms at 1 slot, <= 45 ms at 64 slots, 64 or more callers in real time.\n\n")
    marginal = marginal_per_slot(results)
    c = plan.cost
    measured = (f"{marginal / 2**20:.0f} MiB measured (the growth of the peak from B = {results[0]['B']} to "
                f"{results[-1]['B']}, one tick graph per top-k: whole rings)" if marginal else
                "not measured (no CUDA allocator here)")
    text += ("### Memory per slot and `--slots auto`\n\n"
             + f"- Per slot: {measured}, against {c.total / 2**20:.0f} MiB in the arithmetic (KV "
               f"{c.kv / 2**20:.0f} MiB, Mimi {c.mimi / 2**20:.0f} MiB, activations {c.activations / 2**20:.0f} MiB "
               "for every tick graph the engine may keep).\n"
             + f"- `--slots auto` here: {served.describe()}.\n"
             + f"- Without the cap: {plan.describe()}; the check above ran that many.")
    if a.dry_run:
        text = "_Dry run on the tiny configs; these numbers say nothing about a GPU._\n\n" + text
    return text


if __name__ == "__main__":
    sys.exit(main())
