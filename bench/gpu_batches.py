"""Which batch sizes the GPU acceptance run measures, and how far its largest-real-time search goes.

Both come from the device's free memory by the project's own slot arithmetic (runtime/capacity.py
and runtime/slot_memory.py, the arithmetic of `--slots auto`), so that any CUDA card gets a run
that fits it: 1, then powers of two up to the largest B that fits (64 at most), and a search
bounded by that fit. Each B is guarded: running out of memory at one B costs a line in the report,
not the report. `plan_batches` is the one function that decides, for the real run (free memory
measured after the weights) and for `--dry-run --free-gib N` (a card with N GiB free) alike.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from personaplex_demo.engine.prompt import PREFIX_CACHE_SIZE
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.runtime.capacity import (
    DEFAULT_MAX_SLOTS,
    GiB,
    SlotCost,
    fitting_slots,
    gib,
    safety_margin,
)
from personaplex_demo.runtime.slot_memory import mimi_state_bytes, prefix_cache_bytes, slot_cost

MAX_BATCH = DEFAULT_MAX_SLOTS  # the batch the GPU targets are set for; more says nothing new
FRAME_MS = 80.0


@dataclass(frozen=True)
class BatchPlan:
    """The batch sizes to measure and the search bound, with the numbers behind them."""

    free_bytes: int  # device memory free for slots (after the weights)
    total_bytes: int  # the device's memory, for the safety margin
    cost: SlotCost  # one slot at the whole context
    reserve_bytes: int  # prefix cache, a tick's fixed working memory, safety margin
    fit: int  # slots that fit by the arithmetic
    batches: tuple[int, ...]
    source: str  # where the free figure came from

    @property
    def search_max(self) -> int:
        """The largest B the search may try: the fit (B = 1 is measured even when nothing fits)."""
        return max(1, self.fit)

    def describe(self) -> str:
        return (f"{self.source}: ({gib(self.free_bytes)} free after the weights - {gib(self.reserve_bytes)} "
                f"reserved) / {gib(self.cost.total)} per slot (KV {gib(self.cost.kv)}, Mimi {gib(self.cost.mimi)}, "
                f"activations {gib(self.cost.activations)}) = {self.fit} slots; batches "
                f"{', '.join(map(str, self.batches))}; search up to B = {self.search_max}")


def batch_sizes(fit: int, cap: int = MAX_BATCH) -> tuple[int, ...]:
    """1, then the powers of two up to min(fit, cap). B = 1 even when nothing fits: its
    out-of-memory line is the report's answer then."""
    top = max(1, min(fit, cap))
    return tuple(1 << i for i in range(top.bit_length()))


def plan_batches(cfg: LMConfig, mimi_bytes: int, *, free_bytes: int, total_bytes: int, itemsize: int,
                 voice_frames: int, cuda_graphs: bool, source: str, probe: tuple[int, int] | None = None,
                 cap: int = MAX_BATCH) -> BatchPlan:
    """The batch list and search bound for `free_bytes` free after the weights on a device of
    `total_bytes`: `--slots auto`'s fit, uncapped."""
    # The run makes every row attend its whole ring: the cost at the whole context.
    cost, fixed = slot_cost(cfg, mimi_bytes, cfg.context, itemsize, cuda_graphs, probe)
    reserve = (prefix_cache_bytes(cfg, itemsize, voice_frames, PREFIX_CACHE_SIZE) + fixed
               + safety_margin(total_bytes))
    fit = fitting_slots(free_bytes, reserve, cost)
    return BatchPlan(free_bytes, total_bytes, cost, reserve, fit, batch_sizes(fit, cap), source)


def module_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Device bytes of a (meta-built) module's state in `dtype` (floating tensors; the rest as they are)."""
    return sum(t.numel() * (torch.finfo(dtype).bits // 8 if t.is_floating_point() else t.element_size())
               for t in module.state_dict().values())


def plan_for_card(free_gib: float, lm_cfg: LMConfig, mimi_cfg: MimiConfig, dtype: torch.dtype, voice_frames: int,
                  cuda_graphs: bool) -> BatchPlan:
    """What a card with `free_gib` GiB free before the weights would get: the weights (bf16 LM,
    fp32 Mimi) counted from meta-built models, the tick's working memory by the estimate."""
    from personaplex_demo.model.checkpoint import meta_lm, meta_mimi

    card = int(free_gib * GiB)
    mimi = meta_mimi(mimi_cfg)
    weights = module_bytes(meta_lm(lm_cfg), dtype) + module_bytes(mimi, torch.float32)
    return plan_batches(lm_cfg, mimi_state_bytes(mimi), free_bytes=card - weights, total_bytes=card,
                        itemsize=torch.finfo(dtype).bits // 8, voice_frames=voice_frames, cuda_graphs=cuda_graphs,
                        source=f"a card with {free_gib:g} GiB free ({gib(weights)} of weights)")


def plan_on_device(lm, mimi, device: torch.device, dtype: torch.dtype, weights_bytes: int, voice_frames: int,
                   cuda_graphs: bool, free_gib: float | None = None) -> BatchPlan:
    """The plan for the loaded model on `device`: the memory free now (after the weights), the
    tick's working memory from `slot_memory`'s probe; `free_gib` (GiB free before the weights)
    can only lower what is free, to leave room for someone else on the card."""
    from personaplex_demo.runtime.slot_memory import device_memory, probe_tick_bytes

    try:
        probe = probe_tick_bytes(lm, mimi, device, dtype)
    except Exception as e:  # the estimate still gives a plan, as it does for `--slots auto`
        print(f"  slot memory probe failed ({type(e).__name__}: {e}); using the estimate", flush=True)
        probe = None
    mem = device_memory(device)  # after a gc and emptying the allocator's cache
    if mem is None:
        raise ValueError(f"plan_on_device needs a CUDA device, not {device}")
    (free, total), source = mem, f"{device} as measured"
    if free_gib is not None and int(free_gib * GiB) - weights_bytes < free:
        free, source = int(free_gib * GiB) - weights_bytes, f"{device} limited by --free-gib {free_gib:g}"
    return plan_batches(lm.cfg, mimi_state_bytes(mimi), free_bytes=free, total_bytes=total,
                        itemsize=torch.finfo(dtype).bits // 8, voice_frames=voice_frames, cuda_graphs=cuda_graphs,
                        source=source, probe=probe)


def release(device: torch.device) -> None:
    """Give back what a dropped engine held: it refers to itself through its graph wrappers."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def oom_line(B: int, e: BaseException) -> str:
    first = (str(e).splitlines() or [""])[0]
    return f"out of memory at B={B}" + (f" ({first[:160]})" if first else "")


def measure_batches(measure: Callable[[int], dict], batches: Sequence[int], device: torch.device
                    ) -> tuple[list[dict], list[str]]:
    """`measure(B)` for each B, in order. An out-of-memory error is recorded, its memory freed,
    and the larger batches are skipped (what did not fit at B does not fit above it).
    Returns (the results, the lines for the report)."""
    results: list[dict] = []
    notes: list[str] = []
    for i, B in enumerate(batches):
        try:
            results.append(measure(B))
            continue
        except torch.cuda.OutOfMemoryError as e:
            notes.append(oom_line(B, e))
        # Out of the except block: the traceback, and the engine its frames hold, are gone now.
        release(device)
        print(f"  {notes[-1]}", flush=True)
        if i + 1 < len(batches):
            notes.append(f"B = {', '.join(map(str, batches[i + 1:]))} not tried (larger than B={B})")
        break
    return results, notes


def largest_realtime(measure_ms: Callable[[int], float], known: dict[int, float], cap_s: float, max_b: int,
                     device: torch.device, notes: list[str]) -> tuple[int, int, str]:
    """Binary search for the largest B <= `max_b` whose median engine tick is <= 80 ms; an
    out-of-memory error at B counts as too slow and lowers the bound (noted in `notes`).
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
            t = measure_ms(mid)
        except torch.cuda.OutOfMemoryError as e:
            t = math.inf
            max_b = min(max_b, mid - 1)
            notes.append(oom_line(mid, e) + " (search)")
        if math.isinf(t):
            release(device)
        print(f"  search: B={mid}: {t:.1f} ms", flush=True)
        if t <= FRAME_MS:
            lo = mid
        else:
            hi = mid
    if hi == max_b + 1 and lo == max_b:
        why = "memory bound (no larger B fits on the GPU)"
    return lo, hi, why


# ---- measuring --------------------------------------------------------------------------------


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


def measure_b(setup, B: int, n: int, parts: bool) -> dict:
    """Engine tick at B (and, with `parts`, the LM tick and Mimi alone); peak memory."""
    from bench.gpu_checks import graph_infos, graphs_summary
    from personaplex_demo.engine.cuda_graphs import CudaGraphed

    dev = setup.device
    if dev.type == "cuda":
        release(dev)  # the last engine refers to itself through its graph wrappers
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
        res["graphs"] = graphs_summary(graph_infos(eng.graphed))
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


@dataclass
class Run:
    """The measured batches and the search, with the plan they followed."""

    plan: BatchPlan  # for the card (in a dry run: for --free-gib, the full-size engine)
    batches: tuple[int, ...]  # what this run measured (the tiny configs' in a dry run)
    results: list[dict]
    notes: list[str]  # out-of-memory lines
    lo: int
    hi: int
    why: str
    max_b: int


def measure_all(setup, plan: BatchPlan, batches: tuple[int, ...], max_b: int, ticks: int, search_s: float) -> Run:
    """Each batch (its parts too), guarded against running out of memory, then the search for
    the largest real-time B up to `max_b` (lowered below any B that ran out of memory)."""
    def measure(B: int) -> dict:
        r = measure_b(setup, B, ticks if B < 64 else max(10, ticks * 2 // 3), parts=True)
        print(f"B={B}: tick {ms(r['tick']):.1f} ms, LM {ms(r['lm']):.1f} ms, Mimi {ms(r['mimi']):.1f} ms", flush=True)
        return r

    results, notes = measure_batches(measure, batches, setup.device)
    if len(results) < len(batches):
        max_b = min(max_b, batches[len(results)] - 1)
    known = {r["B"]: ms(r["tick"]) for r in results}
    lo, hi, why = largest_realtime(lambda B: ms(measure_b(setup, B, 10, parts=False)["tick"]), known, search_s,
                                   max_b, setup.device, notes)
    return Run(plan, batches, results, notes, lo, hi, why, max_b)


def marginal_per_slot(results: list[dict]) -> float | None:
    """Device bytes one more slot costs: the growth of the peak between the smallest and the largest B."""
    peaks = [(r["B"], r["peak_per_slot"] * r["B"]) for r in results if r.get("peak_per_slot")]
    if len(peaks) < 2:
        return None
    (b0, p0), (b1, p1) = peaks[0], peaks[-1]
    return (p1 - p0) / (b1 - b0)
