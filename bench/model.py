"""Model costs per 80 ms frame: full-size Mimi streaming and the LM tick at a mid-size config.

    .venv/bin/python bench/model.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import BUDGET_MS, table, time_ms, write_section

from personaplex_demo.engine import LockstepCore, SamplingParams, VoiceTokens
from personaplex_demo.model.checkpoint import meta_lm, meta_mimi
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.model.hashinit import make_tensor


def hash_load(module, kind: str, seed: int):
    state = {k: torch.from_numpy(make_tensor(kind, k, v.shape, seed)) for k, v in module.state_dict().items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval().requires_grad_(False)


def mimi_rows(batches: list[int]) -> list[list[object]]:
    mimi = hash_load(meta_mimi(MimiConfig.personaplex()), "mimi", 4347)
    rows = []
    for B in batches:
        state = mimi.init_state(B)
        pcm = 0.1 * torch.randn(B, 1920)

        def frame():
            with torch.no_grad():
                mimi.decode_step(mimi.encode_step(pcm, state), state)

        ms = time_ms(frame, repeat=10 if B > 1 else 20)
        rows.append([f"full-size Mimi encode+decode, B={B}", f"{ms:.1f}", f"{ms / BUDGET_MS:.2f}",
                     f"{ms / B:.1f}"])
    return rows


def lm_rows(batches: list[int]) -> list[list[object]]:
    cfg = LMConfig.mid()
    lm = hash_load(meta_lm(cfg), "lm", 1242)
    rows = []
    g = torch.Generator().manual_seed(0)
    voice = VoiceTokens("bench", torch.randn(20, cfg.dim, generator=g), torch.full((17, 4), 100, dtype=torch.long))
    for B in batches:
        core = LockstepCore(lm, B)
        for slot in range(B):
            core.start(slot, voice, list(range(100, 140)), SamplingParams(seed=slot), seed=slot)
        codes = torch.randint(0, 2048, (B, 8), generator=g)
        ms = time_ms(lambda: core.step(codes), repeat=20)
        rows.append([f"mid LM tick (temporal + 8 depformer steps), B={B}", f"{ms:.1f}", f"{ms / BUDGET_MS:.2f}",
                     f"{ms / B:.1f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller batches only")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = mimi_rows([1, 4] if a.quick else [1, 4, 16]) + lm_rows([1, 4] if a.quick else [1, 4, 16])
    cfg = LMConfig.mid()
    body = table(["what", "ms per tick", "fraction of 80 ms", "ms per caller"], rows)
    body += (f"\n\nMid-size LM: dim {cfg.dim}, {cfg.num_layers} layers, depformer {cfg.depformer_dim} x "
             f"{cfg.depformer_num_layers}; hash-v1 weights, fp32, CPU. Mimi at full size (79 M parameters).")
    print(body)
    write_section("Model: Mimi and LM step", body, "python bench/model.py" + (" --quick" if a.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
