"""Int8 weights against fp32 (`--weights int8`, model/int8.py): memory, error and CPU speed.

- Memory: the LM's weights as loaded, dense against int8, for the tiny and mid configs (their
  hash-v1 files) and for PersonaPlex-7B by the arithmetic of its checkpoint's keys and shapes
  (`lm_weight_bytes`, bf16; the full-size load itself is bench/fullsize_cpu.py --weights int8).
- Error, fp32 weights against int8 weights on the same file: after each temporal layer, at the
  text logits and at the depformer's logits (steps 0-7), as relative error ||a - b|| / ||a|| and
  the lowest cosine over the batch, over a few frames of random inputs (B = 4).
- The golden greedy sessions (the reference's tokens on the tiny weights) replayed with int8
  weights: where the tokens first part from the reference's, and how many frames differ.
- Speed: the tokens-only `LockstepCore.step` at B = 1, 4, 16, fp32 against int8 weights,
  interleaved in one run, tiny and mid configs.

With `--full-size` the error table also has PersonaPlex-7B's temporal transformer, layer by layer
(its fp32 copy would not fit in memory whole), and its text logits.

    python bench/int8.py [--quick] [--full-size] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import fmt_ms, interleave, md_table, replace_section  # noqa: E402
from bench.engines import core_stepper, mid_lm_config  # noqa: E402
from bench.model import LM_SEED, bench_persona, bench_voice, hash_file  # noqa: E402
from personaplex_demo.model.checkpoint import load_lm, meta_lm, write_hash_checkpoint  # noqa: E402
from personaplex_demo.model.config import LMConfig  # noqa: E402
from personaplex_demo.model.transformer import RMSNorm  # noqa: E402
from tests.conftest import golden  # noqa: E402
from tests.lm_fixtures import real_lm_shapes  # noqa: E402
from tests.support.int8 import lm_weight_bytes, weight_bytes  # noqa: E402
from tests.test_lm_golden import run_session  # noqa: E402

SECTION = "Int8 weights: memory, error and speed on the CPU"
READING = """**Reading it.** The weights here are hash-v1 stand-ins, not trained ones: the error figures say
how much the int8 rounding moves the activations and logits (about 1 % relative at the logits, a
cosine above 0.999), not what it does to a conversation. On such weights the logits of different
tokens lie close together, so greedy decoding follows the rounding: the golden sessions agree on
the prompt and part from the reference's tokens within the first conversation frames, after
which every frame differs (a different trajectory, not growing noise). The memory column is the
point: the tiny model is mostly embeddings, which stay; the full-size LM drops to 0.53 of bf16.
On the CPU an int8 layer first widens its weights back to the activations' dtype, a copy per
call, so the tick is not faster here; whether the smaller weights pay on a GPU, where the tick
reads every weight once per step, is what `bash bench/gpu.sh` measures when a GPU is lent."""
MB = 1e6


def configs() -> dict[str, tuple[LMConfig, Path]]:
    tiny, mid = LMConfig.tiny(), mid_lm_config()
    return {"tiny": (tiny, hash_file("lm", "lm-tiny", lambda: meta_lm(tiny), LM_SEED)),
            "mid": (mid, hash_file("lm", "lm-mid", lambda: meta_lm(mid), LM_SEED))}


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    return float((a - b).norm() / a.norm()), float(torch.nn.functional.cosine_similarity(a, b).min())


@torch.no_grad()
def errors(cfg: LMConfig, dense, int8, frames: int = 4, batch: int = 4) -> list[list]:
    """Relative error and cosine per temporal layer (their last frame), at the text logits and at the
    depformer's logits, after `frames` frames of random embeddings."""
    captured: dict[str, list[torch.Tensor]] = {"dense": [], "int8": []}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, name=name: captured[name].append(out))
             for name, lm in (("dense", dense), ("int8", int8)) for layer in lm.transformer.layers]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, 1, cfg.dim, generator=g) for _ in range(frames)]
    active = torch.ones(batch, dtype=torch.bool)
    out = {}
    for name, lm in (("dense", dense), ("int8", int8)):
        kv = lm.new_kv(batch, "cpu", torch.float32)
        for x in xs:
            captured[name].clear()
            h = lm.temporal_step(x, kv, active)
        logits: list[torch.Tensor] = []
        # The int8 depformer gets the dense one's tokens as its inputs, so that only the weights differ.
        tok, forced = (lm.text_logits(h).argmax(-1), torch.zeros(batch, 8, dtype=torch.long)) if name == "dense" \
            else out["dense"][1]
        chosen = lm.depformer_frame(h, tok, forced, torch.full((batch, 8), name != "dense"), 8,
                                    lambda _s, lg, logits=logits: (logits.append(lg), lg.argmax(-1))[1])
        out[name] = (lm.text_logits(h), (tok, chosen), logits)
    for h in hooks:
        h.remove()
    rows = [[f"temporal layer {i}", *fmt(relative(a, b))]
            for i, (a, b) in enumerate(zip(captured["dense"], captured["int8"], strict=True))]
    rows.append(["text logits", *fmt(relative(out["dense"][0], out["int8"][0]))])
    dep = [relative(a, b) for a, b in zip(out["dense"][2], out["int8"][2], strict=True)]
    rows.append(["depformer logits, steps 0-7 (worst)", f"{max(d[0] for d in dep):.4f}", f"{min(d[1] for d in dep):.6f}"])
    return rows


@torch.no_grad()
def fullsize_errors(path: Path, cfg: LMConfig | None = None, frames: int = 3, batch: int = 2) -> list[list]:
    """The same comparison on the full-size temporal transformer, a layer at a time (its fp32 copy
    would not fit in memory whole): each layer's weights are read, in fp32 and as int8, both copies
    run their own stream of hidden states through it over `frames` frames, and the text logits
    come from the (dense) final norm and head."""
    from personaplex_demo.model.checkpoint import read_tensors
    from personaplex_demo.model.int8 import attach_scales, quantize_rows
    from personaplex_demo.model.lm import LMLayer
    from personaplex_demo.model.ring import RingKV
    from personaplex_demo.model.transformer import rope_angles

    cfg = cfg or LMConfig()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (frames, batch, 17), generator=g)
    tables = dict((k, t.float().clone()) for k, t in read_tensors(path, [f"emb.{i}.weight" for i in range(16)]
                                                                      + ["text_emb.weight"]))
    x = torch.stack([sum(tables[f"emb.{i}.weight"][ids[f, :, 1 + i]] for i in range(16))
                     + tables["text_emb.weight"][ids[f, :, 0]] for f in range(frames)])[:, :, None]  # [F, B, 1, D]
    del tables
    streams, rows = {"dense": x, "int8": x.clone()}, []
    all_keys = list(meta_lm(cfg).state_dict())
    for i in range(cfg.num_layers):
        prefix = f"transformer.layers.{i}."
        keys = [k for k in all_keys if k.startswith(prefix)]
        dense_state = {k[len(prefix):]: t.float().clone() for k, t in read_tensors(path, keys)}
        for name in ("dense", "int8"):
            with torch.device("meta"):
                layer = LMLayer(cfg.dim, cfg.num_heads, cfg.hidden, cfg.norm_eps)
            state, scales = dict(dense_state), {}
            if name == "int8":
                for k in [k for k in state if k.endswith("weight") and state[k].dim() == 2]:
                    state[k], scales[k] = quantize_rows(state[k], torch.float32)
            layer.requires_grad_(False).load_state_dict(state, assign=True)
            attach_scales(layer, scales)
            kv = RingKV.empty(1, batch, cfg.num_heads, frames, cfg.head_dim, "cpu", torch.float32)
            out = []
            for f in range(frames):
                attend = kv.advance(1, cfg.context)
                angles = rope_angles(attend.positions, cfg.head_dim, cfg.max_period)
                out.append(layer(streams[name][f], attend, angles, kv.layers[0]))
            streams[name] = torch.stack(out)
        rows.append([f"temporal layer {i}", *fmt(relative(streams["dense"][-1], streams["int8"][-1]))])
    head = dict((k, t.float().clone()) for k, t in read_tensors(path, ["out_norm.alpha", "text_linear.weight"]))
    norm = RMSNorm(cfg.dim, cfg.norm_eps)
    norm.alpha.data = head["out_norm.alpha"]
    logits = {n: torch.nn.functional.linear(norm(s[-1])[:, 0], head["text_linear.weight"]) for n, s in streams.items()}
    rows.append(["text logits", *fmt(relative(logits["dense"], logits["int8"]))])
    return rows


def fmt(pair: tuple[float, float]) -> list[str]:
    return [f"{pair[0]:.4f}", f"{pair[1]:.6f}"]


def golden_divergence() -> list[list]:
    rows = []
    for fixture in ("lm-greedy.json", "lm-wrap.json"):
        first_o = golden(fixture)["summary"]["first_conversation_o"]
        expected, actual = run_session(fixture, stepwise=False, weights="int8")
        differ = [(o, sum(x != y for x, y in zip(e, a, strict=True)))
                  for (o, e), (_, a) in zip(expected, actual, strict=True) if a != e]
        first = f"frame {differ[0][0] - first_o} ({differ[0][1]} of 17 tokens)" if differ else "none"
        rows.append([fixture, len(expected), first, len(differ)])
    return rows


def speed(quick: bool) -> list[list]:
    rows = []
    for name, (cfg, path) in configs().items():
        lms = {w: load_lm(cfg, path, torch.float32, weights=w) for w in ("dense", "int8")}
        for B in (1, 4, 16):
            voice, persona = bench_voice(cfg, 10), bench_persona(10)
            cases = {w: core_stepper(lm, B, voice, persona, context=200) for w, lm in lms.items()}
            with torch.no_grad():
                st = interleave(cases, rounds=4 if quick else 12, per_round=2, warmup=2)
            d, q = st["dense"].median, st["int8"].median
            rows.append([name, B, fmt_ms(d), fmt_ms(q), f"{q / d:.2f}"])
    return rows


def memory() -> list[list]:
    rows = []
    for name, (cfg, path) in configs().items():
        dense, int8 = (weight_bytes(load_lm(cfg, path, torch.float32, weights=w)) for w in ("dense", "int8"))
        rows.append([f"{name} (fp32 file, loaded)", f"{dense / MB:.1f} MB", f"{int8 / MB:.1f} MB", f"{int8 / dense:.2f}"])
    real = real_lm_shapes()
    dense, int8 = lm_weight_bytes(real, "dense", 2), lm_weight_bytes(real, "int8", 2)
    rows.append(["PersonaPlex-7B in bf16 (arithmetic)", f"{dense / 2**30:.2f} GiB", f"{int8 / 2**30:.2f} GiB",
                 f"{int8 / dense:.2f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--full-size", action="store_true",
                    help="also the error on the full-size temporal transformer (writes a 16.7 GB file, minutes)")
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    mem = md_table(["LM", "dense", "int8", "int8 / dense"], memory())
    err = []
    for name, (cfg, path) in configs().items():
        dense, int8 = (load_lm(cfg, path, torch.float32, weights=w) for w in ("dense", "int8"))
        err += [[name, *row] for row in errors(cfg, dense, int8)]
    if a.full_size:
        with tempfile.TemporaryDirectory(prefix="pp-int8-") as tmp:
            path = write_hash_checkpoint(meta_lm(LMConfig()), Path(tmp) / "model.safetensors", "lm",
                                         LM_SEED, torch.bfloat16)
            err += [["PersonaPlex-7B (hash-v1, bf16 file)", *row] for row in fullsize_errors(path)]
    err_t = md_table(["config", "where", "relative error", "lowest cosine"], err)
    gold = md_table(["golden session (tiny, greedy)", "conversation frames", "first frame that differs",
                     "frames that differ"], golden_divergence())
    spd = md_table(["config", "B", "fp32 tick (ms)", "int8 tick (ms)", "int8 / fp32"], speed(a.quick))
    body = (f"### Memory\n\n{mem}\n\n### Error against fp32 weights\n\n{err_t}\n\n{gold}\n\n"
            f"### Speed: the tokens-only LM tick\n\n{spd}\n\n{READING}\n")
    print(body)
    if not a.no_write:
        replace_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
