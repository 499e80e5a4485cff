"""bench/gpu.py's last pass: the same engine with `--weights int8`, beside the bf16 figures.

After every bf16 measurement, the LM's weights are quantized in place (`quantize_loaded`, the
same rows and scales the loader makes) and the engine is measured again at B = 1, 16 and 64
(those the bf16 plan measured), then the largest real-time B is searched up to the bf16 bound.
The weights' bytes come from the allocator, and the peak per slot as for bf16.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_batches import FRAME_MS, Run, largest_realtime, measure_b, measure_batches, ms, release, sync
from tests.support.int8 import quantize_loaded

INT8_BATCHES = (1, 16, 64)


def int8_pass(setup, bf16: Run, ticks: int, search_s: float) -> dict:
    """Quantize `setup.lm` in place and measure; the figures for `render_int8`."""
    dev = setup.device
    t0 = time.perf_counter()
    dense_bytes = setup.weights_bytes
    try:
        tensors = quantize_loaded(setup.lm)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # the bf16 figures must still be written
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    if dev.type == "cuda":
        release(dev)
        sync(dev)
        setup.weights_bytes = torch.cuda.memory_allocated(dev)
    quantize_s = time.perf_counter() - t0
    batches = tuple(B for B in INT8_BATCHES if B in bf16.batches) or bf16.batches[:1]

    def measure(B: int) -> dict:
        r = measure_b(setup, B, ticks, parts=False)
        print(f"int8 B={B}: tick {ms(r['tick']):.1f} ms", flush=True)
        return r

    results, notes = measure_batches(measure, batches, dev)
    known = {r["B"]: ms(r["tick"]) for r in results}
    lo, hi, why = largest_realtime(lambda B: ms(measure_b(setup, B, 10, parts=False)["tick"]), known, search_s,
                                   bf16.max_b, dev, notes)
    return {"tensors": tensors, "quantize_s": quantize_s, "dense_bytes": dense_bytes,
            "int8_bytes": setup.weights_bytes, "results": results, "notes": notes, "lo": lo, "hi": hi, "why": why,
            "bf16": {r["B"]: r for r in bf16.results}}


def render_int8(run: dict) -> str:
    from bench.common import md_table

    if "error" in run:
        return f"### Int8 weights beside bf16 (`--weights int8`)\n\nNot measured: quantizing failed ({run['error']}).\n"
    rows = []
    for r in run["results"]:
        dense = run["bf16"].get(r["B"])
        peak = r.get("peak_per_slot")
        rows.append([r["B"], f"{ms(r['tick']):.1f}", f"{ms(r['tick'], 99):.1f}", f"{ms(r['tick']) / FRAME_MS:.2f}",
                     f"{ms(dense['tick']):.1f}" if dense else "n/a",
                     f"{ms(r['tick']) / ms(dense['tick']):.2f}" if dense else "n/a",
                     f"{peak / 2**20:.0f}" if peak else "n/a"])
    weights = (f"LM and Mimi weights {run['dense_bytes'] / 2**30:.2f} GiB with bf16, "
               f"{run['int8_bytes'] / 2**30:.2f} GiB with int8 ({run['tensors']} tensors quantized in "
               f"{run['quantize_s']:.1f} s)" if run["dense_bytes"] else
               f"{run['tensors']} tensors quantized in {run['quantize_s']:.1f} s (no CUDA allocator to weigh them)")
    search = f"**{run['lo']}**" + f"; search: {run['why']}"
    return ("### Int8 weights beside bf16 (`--weights int8`)\n\n"
            + md_table(["B", "int8 engine tick ms (median)", "p99 ms", "fraction of 80 ms", "bf16 tick ms",
                        "int8 / bf16", "peak MiB per slot"], rows)
            + f"\n\n- {weights}.\n- Largest B in real time with int8 weights: {search}.\n"
            + "".join(f"- {n[:1].upper() + n[1:]}.\n" for n in run["notes"]))
