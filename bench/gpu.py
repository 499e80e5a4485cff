"""GPU benchmark of the full-size engine (hash-v1 weights, bf16, CUDA graphs) for one lent GPU.

    bash bench/gpu.sh            # on a CUDA machine, < 8 minutes
    python bench/gpu.py --dry-run   # anywhere: the same code path on the tiny config, on the CPU

Reports tick time at B = 1/16/64, the largest B that stays real time, Mimi cost at B = 64 and
peak memory per slot, and writes the "## GPU" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from common import BUDGET_MS, table, write_section

from personaplex_demo.engine import LockstepCore, SamplingParams, VoiceTokens
from personaplex_demo.model.checkpoint import meta_lm, meta_mimi
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.model.hashinit import rule
from personaplex_demo.sampling import _fmix32


def hash_on_device(kind: str, key: str, shape, seed: int, device, dtype) -> torch.Tensor:
    """hash-v1 computed with torch on the device (the numpy recipe is too slow for 8.4 B values)."""
    import zlib

    offset, scale = rule(kind, key, shape)
    n = math.prod(shape)
    if scale == 0.0:
        return torch.full(tuple(shape), offset, device=device, dtype=dtype)
    c = int(_fmix32(torch.tensor(zlib.crc32(key.encode()) ^ int(_fmix32(torch.tensor(seed)))))) & 0xFFFFFFFF
    out = torch.empty(n, device=device, dtype=dtype)
    step = 1 << 26
    for s in range(0, n, step):
        i = torch.arange(s, min(n, s + step), device=device, dtype=torch.long)
        h = _fmix32(((i * 0x9E3779B1) & 0xFFFFFFFF) ^ c)
        u = h.double() / 4294967296.0
        out[s:s + i.numel()] = ((2.0 * u - 1.0) * scale + offset).to(dtype)
    return out.view(tuple(shape))


def build(module, kind: str, seed: int, device, dtype):
    state = {k: hash_on_device(kind, k, tuple(v.shape), seed, device, dtype if v.is_floating_point() else torch.float32)
             for k, v in module.state_dict().items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tick_ms(lm, B: int, device, dtype, graphs: bool, n: int = 30) -> float:
    core = LockstepCore(lm, B, device, dtype, cuda_graphs=graphs)
    voice = VoiceTokens("bench", torch.randn(50, lm.cfg.dim, device=device, dtype=dtype),
                        torch.full((17, 4), 100, dtype=torch.long))
    for slot in range(B):
        core.start(slot, voice, list(range(200, 260)), SamplingParams(seed=slot), seed=slot)
    codes = torch.randint(0, 2048, (B, 8), device=device)
    for _ in range(5):
        core.step(codes)
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        core.step(codes)
    sync(device)
    return (time.perf_counter() - t) * 1000 / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="tiny config on whatever device exists")
    ap.add_argument("--no-graphs", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available() and not a.dry_run:
        print("bench/gpu.py needs a CUDA GPU; use --dry-run to check the code path on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    lm_cfg = LMConfig.tiny() if a.dry_run else LMConfig.personaplex_7b()
    mimi_cfg = MimiConfig.tiny() if a.dry_run else MimiConfig.personaplex()
    t = time.perf_counter()
    lm = build(meta_lm(lm_cfg), "lm", 1242, device, dtype)
    mimi = build(meta_mimi(mimi_cfg), "mimi", 4347, device, torch.float32)
    print(f"weights built in {time.perf_counter() - t:.0f} s", flush=True)
    graphs = not a.no_graphs
    rows = []
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for B in (1, 16, 64):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = tick_ms(lm, B, device, dtype, graphs)
        peak = (torch.cuda.max_memory_allocated() - base) / B / 2**20 if device.type == "cuda" else float("nan")
        rows.append([B, f"{ms:.1f}", f"{ms / BUDGET_MS:.2f}", f"{peak:.0f}"])
        print(rows[-1], flush=True)
    # Largest real-time batch: double while under budget (with Mimi's share), then bisect.
    state = mimi.init_state(64, device=device)
    pcm = 0.1 * torch.randn(64, 1920, device=device)
    with torch.no_grad():
        for _ in range(3):
            mimi.decode_step(mimi.encode_step(pcm, state), state)
        sync(device)
        t = time.perf_counter()
        for _ in range(10):
            mimi.decode_step(mimi.encode_step(pcm, state), state)
        sync(device)
    mimi_ms = (time.perf_counter() - t) * 100
    lo, hi = 1, 1
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and tick_ms(lm, hi * 2, device, dtype, graphs, n=10) + mimi_ms * hi * 2 / 64 \
            < BUDGET_MS and hi < 512:
        hi *= 2
    lo = hi
    body = table(["B", "LM tick ms", "fraction of 80 ms", "peak MiB per slot"], rows)
    body += (f"\n\nMimi encode+decode at B=64: {mimi_ms:.1f} ms per frame. Largest real-time batch (LM + Mimi "
             f"share, powers of two): {lo}. Device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
             f", {'CUDA graphs' if graphs else 'eager'}, {str(dtype).removeprefix('torch.')}"
             f"{', dry run on the tiny config' if a.dry_run else ''}.")
    print(body)
    if not a.dry_run:
        write_section("GPU", body, "bash bench/gpu.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
