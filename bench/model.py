"""Model costs per 80 ms frame, ours beside the reference on the same weights.

- Full-size Mimi (79 M parameters, hash-v1 weights): streaming encode and decode of one frame
  per row at B = 1, 4 (and 16 unless --quick).
- The LM tick at the mid-size config (`mid_lm_config()`): `LockstepCore.step` (tokens only:
  staging ring, temporal step, text sampling, 8 depformer steps), and the bare network of that
  tick (temporal + out_norm + text_linear + 8 depformer steps, greedy) at B = 1, 4, 16.

When PyPI `moshi==0.2.13` is importable, it builds the same networks from the same safetensors
file and runs in the same process, interleaved with ours, so both see the same CPU load. Its
outputs are compared with ours before timing. The project never needs it.

    .venv/bin/python bench/model.py [--quick] [--no-write] [--profile]
    /tmp/moshi-venv/bin/python bench/model.py      # with the reference installed (BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import (
    FRAME_MS,
    REFERENCE_MISSING,
    LoadWatch,
    fmt_frac,
    fmt_ms,
    import_reference,
    interleave,
    machine,
    md_table,
    reference_version,
    replace_section,
)
from bench.engines import mid_lm_config
from personaplex_demo.engine.core import LockstepCore
from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.engine.prompt import VoiceTokens
from personaplex_demo.model.checkpoint import load_lm, load_mimi, meta_lm, meta_mimi, write_hash_checkpoint
from personaplex_demo.model.config import LMConfig, MimiConfig
from tests.support.signals import mimi_input

SECTION = "Model: Mimi and LM step"
LM_SEED, MIMI_SEED = 1242, 4347
VOICE_T, PERSONA_P = 50, 60


def bench_cache() -> Path:
    from personaplex_demo.runtime.tiny import default_cache_dir

    return Path(os.environ.get("PERSONAPLEX_BENCH_CACHE") or default_cache_dir() / "bench")


def hash_file(kind: str, name: str, module_fn, seed: int) -> Path:
    """hash-v1 weights in the official layout, written once per (config, seed)."""
    path = bench_cache() / f"{name}-hash-v1-seed{seed}.safetensors"
    if not path.is_file():
        print(f"writing {path} (once)", flush=True)
        write_hash_checkpoint(module_fn(), path, kind, seed)
    return path


# ---- the reference, built from the same file ----------------------------------------------------


def reference_mimi(path: Path):
    from moshi.models import loaders
    from safetensors.torch import load_file

    mimi = loaders.get_mimi(None, device="cpu")  # its built-in config is PersonaPlex's Mimi
    mimi.load_state_dict(load_file(str(path)), strict=True)
    mimi.set_num_codebooks(8)
    return mimi.eval().requires_grad_(False)


def reference_lm(path: Path, cfg: LMConfig):
    from moshi.models import loaders
    from moshi.models.lm import LMModel
    from safetensors.torch import load_file

    kw = dict(loaders._lm_kwargs)
    kw.update(dim=cfg.dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers, context=cfg.context,
              depformer_dim=cfg.depformer_dim, depformer_num_heads=cfg.depformer_num_heads,
              depformer_num_layers=cfg.depformer_num_layers,
              depformer_dim_feedforward=cfg.depformer_dim_feedforward, dep_q=cfg.dep_q)
    kw.pop("depformer_causal", None)  # collides with 0.2.13's own `causal` argument
    with torch.device("meta"):
        lm = LMModel(**kw)
    # Its load pre-hook splits the fused in_proj_weight / out_proj.weight into per-step keys.
    lm.load_state_dict(load_file(str(path)), strict=True, assign=True)
    return lm.eval().requires_grad_(False)


# ---- Mimi ---------------------------------------------------------------------------------------


def mimi_rows(batches: list[int], ref, rounds: int, cap_s: float, profile: bool) -> tuple[list, list[str]]:
    cfg = MimiConfig()
    path = hash_file("mimi", "mimi-full", lambda: meta_mimi(cfg), MIMI_SEED)
    ours = load_mimi(cfg, path)
    theirs = reference_mimi(path) if ref is not None else None
    rows, notes = [], []
    for B in batches:
        n_frames = 24
        pcm = torch.from_numpy(np.stack([mimi_input(n_frames, seed=b) for b in range(B)], axis=1))  # [N, B, 1920]
        codes = torch.from_numpy(np.random.default_rng(B).integers(0, 2048, size=(B, 8)))
        state = ours.init_state(B)
        pos = {"ours": 0, "ref": 0}

        def frame(who: str) -> torch.Tensor:
            x = pcm[pos[who] % n_frames]
            pos[who] += 1
            return x

        with ExitStack() as stack, torch.no_grad():
            cases = {"ours encode": lambda: ours.encode_step(frame("ours"), state),
                     "ours decode": lambda: ours.decode_step(codes, state)}
            if theirs is not None:
                stack.enter_context(theirs.streaming(B))
                cases["ref encode"] = lambda: theirs.encode(frame("ref")[:, None])
                cases["ref decode"] = lambda: theirs.decode(codes[:, :, None])
                # Same streams from the same start: outputs must agree before we time anything.
                same_codes, pcm_diff = True, 0.0
                for _ in range(3):
                    a, b = ours.encode_step(frame("ours"), state), theirs.encode(frame("ref")[:, None])[..., 0]
                    same_codes &= bool(torch.equal(a, b))
                    pa, pb = ours.decode_step(a, state), theirs.decode(b[..., None])[:, 0]
                    pcm_diff = max(pcm_diff, float((pa - pb).abs().max()))
                notes.append(f"B={B}: codes {'identical' if same_codes else 'DIFFERENT'}, "
                             f"PCM max |Δ| {pcm_diff:.1e} over 3 frames")
            stats = interleave(cases, rounds=rounds, per_round=1, warmup=3, max_seconds=cap_s)
            if profile:
                profile_cases(f"Mimi B={B}", cases)
        enc, dec = stats["ours encode"], stats["ours decode"]
        total = enc.median + dec.median
        best = enc.min + dec.min
        row = [B, fmt_ms(enc.median), fmt_ms(dec.median), fmt_ms(total), fmt_ms(enc.p99 + dec.p99), fmt_ms(best)]
        if theirs is not None:
            r_enc, r_dec = stats["ref encode"], stats["ref decode"]
            ref_total, ref_best = r_enc.median + r_dec.median, r_enc.min + r_dec.min
            row += [fmt_ms(ref_total), fmt_ms(ref_best), f"{total / ref_total:.2f} ({best / ref_best:.2f})"]
        else:
            row += ["n/a", "n/a", "n/a"]
        row += [fmt_frac(1000 * total / FRAME_MS), fmt_ms(total / B), f"{enc.n}+{dec.n}"]
        rows.append(row)
        print("mimi", row, flush=True)
    return rows, notes


# ---- LM -----------------------------------------------------------------------------------------


def bench_voice(cfg: LMConfig, T: int = VOICE_T, seed: int = 0) -> VoiceTokens:
    g = torch.Generator().manual_seed(seed)
    return VoiceTokens(f"bench-{T}", torch.randn(T, cfg.dim, generator=g),
                       torch.randint(0, 2048, (17, max(cfg.delays) + 3), generator=g))  # the staging ring [17, CT]


def bench_persona(P: int = PERSONA_P) -> list[int]:
    return [int(x) for x in np.random.default_rng(P).integers(260, 32000, size=P)]


def lm_rows(batches: list[int], ref, rounds: int, cap_s: float, profile: bool) -> tuple[list, list[str]]:
    cfg = mid_lm_config()
    path = hash_file("lm", "lm-mid", lambda: meta_lm(cfg), LM_SEED)
    ours = load_lm(cfg, path)
    theirs = reference_lm(path, cfg) if ref is not None else None
    voice, persona = bench_voice(cfg), bench_persona()
    rows, notes = [], []
    argmax = lambda s, logits: logits.argmax(-1)  # noqa: E731
    for B in batches:
        g = torch.Generator().manual_seed(B)
        # "tick": every row attends its whole ring, as calls past 240 s do (the worst case);
        # "tick, filled ring": as served to young calls, attending only the filled slots.
        cores = {True: LockstepCore(ours, B), False: LockstepCore(ours, B, attend_filled=False)}
        for core in cores.values():
            for slot in range(B):
                core.start(slot, voice, persona, SamplingParams(seed=slot), seed=slot)  # served defaults: sampling
        user = [torch.randint(0, 2048, (B, 8), generator=g) for _ in range(16)]
        tick_no = {True: 0, False: 0}

        def tick(filled: bool = False) -> None:
            cores[filled].step(user[tick_no[filled] % 16])
            tick_no[filled] += 1

        # The bare network of one tick, ours and theirs, on the same input column.
        col = torch.cat([torch.randint(0, 32000, (B, 1), generator=g), torch.randint(0, 2048, (B, 16), generator=g)], 1)
        kv = ours.new_kv(B, "cpu", torch.float32)
        active = torch.ones(B, dtype=torch.bool)
        no_force = torch.zeros(B, 8, dtype=torch.long), torch.zeros(B, 8, dtype=torch.bool)

        def ours_net() -> torch.Tensor:
            h = ours.temporal_step(ours.embed_codes(col), kv, active)
            text = ours.text_logits(h).argmax(-1)
            return torch.cat([text[:, None], ours.depformer_frame(h, text, *no_force, 8, argmax)], 1)

        def ref_net() -> torch.Tensor:
            h, text_logits = theirs.forward_text(col[:, :, None])
            prev = text_logits[:, 0, 0].float().argmax(-1)
            out = [prev]
            with theirs.depformer.streaming(B):
                for s in range(8):  # 8 steps, as ours (the user steps 8..15 are skipped, docs/model.md)
                    prev = theirs.forward_depformer(s, prev[:, None, None], h)[:, 0, 0].float().argmax(-1)
                    out.append(prev)
            return torch.stack(out, 1)

        with ExitStack() as stack, torch.no_grad():
            cases = {"ours tick": tick, "ours tick filled": lambda: tick(True), "ours net": ours_net}
            if theirs is not None:
                stack.enter_context(theirs.streaming(B))
                cases["ref net"] = ref_net
                same = all(torch.equal(ours_net(), ref_net()) for _ in range(3))
                notes.append(f"B={B}: greedy tokens {'identical' if same else 'DIFFERENT'} over 3 steps")
            stats = interleave(cases, rounds=rounds, per_round=1, warmup=3, max_seconds=cap_s)
            if profile:
                profile_cases(f"mid LM B={B}", cases)
        t, n = stats["ours tick"], stats["ours net"]
        row = [B, fmt_ms(t.median), fmt_ms(t.p99), fmt_ms(stats["ours tick filled"].median), fmt_ms(n.median),
               fmt_ms(n.min)]
        if theirs is not None:
            r = stats["ref net"]
            row += [fmt_ms(r.median), fmt_ms(r.min), f"{n.median / r.median:.2f} ({n.min / r.min:.2f})",
                    f"{t.median / r.median:.2f}"]
        else:
            row += ["n/a", "n/a", "n/a", "n/a"]
        row += [fmt_frac(t.budget()), fmt_ms(t.median / B), f"{t.n}"]
        rows.append(row)
        print("lm", row, flush=True)
    return rows, notes


# ---- profiling ----------------------------------------------------------------------------------


def profile_cases(title: str, cases: dict, calls: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in cases.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
        print(f"\n=== profile: {title}, {name} ({calls} calls) ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


# ---- main ---------------------------------------------------------------------------------------


NOTES = """\
**Columns.** Mimi "total" is encode + decode of one frame per row. LM "tick" is
`LockstepCore.step` as served (staging ring, sampling with the default temperature and top-k,
8 depformer steps); "net" is the bare network of one tick, greedy: embeddings, temporal step,
out_norm, text_linear and 8 depformer steps. The reference can run only that part (with 16
depformer steps its `LMGen` generates the user's stream instead of taking it as input, so it
cannot run PersonaPlex), so "net ours / ref" compares like with like and "tick / ref
net" adds our lockstep and sampler on top of our network. "tick" and "net" attend the whole
3000-slot ring (as calls past 240 s do, and as the reference always does); "tick, filled ring"
is the served tick of calls younger than that, which attends only the filled slots (here about
200, read as one 256-slot bucket).

**What dominates** (torch.profiler on this machine). Mimi at B = 1: the two 8-layer transformers
(matmuls on 2 steps per frame, attention over the 250-slot ring) and the convolutions next to
the latent; at B = 16 the convolutions take over, led by the encoder's last downsampling conv
(512 -> 1024 channels, kernel 16, stride 8) and the decoder's first transposed conv (1024 -> 512,
kernel 16, stride 8). PyTorch runs that transposed conv on the CPU through its slow
`slow_conv_transpose2d` path (about 33 ms of a 125 ms decode at B = 16, as the reference still
does); ours runs it as one matmul and a shift-add (`StreamingConvTranspose1d._step_matmul`,
tested against the conv): timed alone on the machine of this table, 27 -> 3.3 ms at B = 1 and
35 -> 11 ms at B = 16. The other operators are the same as the reference's.
Mid LM at B = 1: the matmuls (weights are read once per tick; text_linear,
512 x 32000, is the largest) and about 1,700 small operators per tick; at B = 16 the temporal
attention is about half the tick when every row reads all 3000 slots of every layer's ring
although only about 200 are filled, as the reference does; the filled-ring tick reads one
256-slot bucket instead. The lockstep and the sampler (softmax + top-k over 32000 text and 8 x 2048 audio logits,
hashed noise) add 5-10 ms per tick. `temporal_step` computes the RoPE angles and the ring mask
once per tick for all layers (about 2 % of the mid-size tick here).

**What would make it faster** (not applied): the other decoder transposed convs have longer
inputs (16 to 480 steps per frame), where PyTorch's conv is already as fast as a matmul; at
B = 16 the encoder's strided convs are next. For the LM at B = 16 with full rings, the temporal
attention stays about half the tick: it is the KV cache that must be read."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B = 1, 4 only and fewer rounds (a check run)")
    ap.add_argument("--no-reference", action="store_true", help="do not import moshi even if installed")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of every case")
    ap.add_argument("--only", choices=["mimi", "lm"], help="run one half")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    info = machine()
    watch = LoadWatch()
    ref = None if a.no_reference else import_reference()
    rounds, cap = (8, 6.0) if a.quick else (60, 40.0)
    mimi_b = [1, 4] if a.quick else [1, 4, 16]
    lm_b = [1, 4] if a.quick else [1, 4, 16]
    m_rows, m_notes = mimi_rows(mimi_b, ref, rounds, cap, a.profile) if a.only != "lm" else ([], [])
    l_rows, l_notes = lm_rows(lm_b, ref, rounds, cap, a.profile) if a.only != "mimi" else ([], [])
    cfg = mid_lm_config()
    body = ""
    if m_rows:
        body += ("### Full-size Mimi, streaming, one 80 ms frame per row (fp32)\n\n"
                 + md_table(["B", "ours encode ms", "ours decode ms", "ours total ms", "ours p99 ms", "ours best ms",
                             "ref total ms", "ref best ms", "ours / ref (best)", "fraction of 80 ms", "ms per caller",
                             "calls"], m_rows) + "\n\n")
    if l_rows:
        body += (f"### LM tick at the mid-size config (dim {cfg.dim}, {cfg.num_layers} layers, context "
                 f"{cfg.context}; depformer {cfg.depformer_dim} x {cfg.depformer_num_layers}, 8 steps; fp32)\n\n"
                 + md_table(["B", "ours tick ms", "ours tick p99 ms", "ours tick, filled ring ms", "ours net ms",
                             "ours net best ms", "ref net ms",
                             "ref net best ms", "net ours / ref (best)", "tick / ref net", "tick fraction of 80 ms",
                             "tick ms per caller", "calls"], l_rows)
                 + "\n\n")
    checks = m_notes + l_notes
    if ref is not None:
        body += (f"Reference: `moshi` {reference_version(ref)} (PyPI), built from the same hash-v1 safetensors file and "
                 f"timed in the same process, interleaved with ours, one call per case per round. Before timing, "
                 f"the outputs were compared: {'; '.join(checks)}. ")
    else:
        body += f"_{REFERENCE_MISSING}._ "
    body += ("Times are medians over all calls; \"best\" is the fastest call, which the other processes on this "
             "machine disturb least, and the ratio in brackets is that of the best calls.\n\n")
    body += REFERENCE_HOWTO + "\n\n" + NOTES
    body += f"\n\nCPU load during the run: {watch.summary()}."
    print("\n" + body)
    if not a.no_write:
        replace_section(SECTION, body, info=info)
    return 0


REFERENCE_HOWTO = """\
To install the reference beside the project (it pins `torch<2.10`, so install it without its
dependencies): `python3 -m venv /tmp/moshi-venv && /tmp/moshi-venv/bin/pip install torch==2.13.0 &&
/tmp/moshi-venv/bin/pip install --no-deps moshi==0.2.13 && /tmp/moshi-venv/bin/pip install 'numpy<2.3'
safetensors 'einops<0.9' sentencepiece 'sphn<0.3' 'huggingface-hub<1' tqdm && /tmp/moshi-venv/bin/pip
install --no-deps -e .`, then run with `NO_TORCH_COMPILE=1 /tmp/moshi-venv/bin/python bench/model.py`
(`bench/run_all.sh` picks that interpreter when it exists)."""


if __name__ == "__main__":
    sys.exit(main())
