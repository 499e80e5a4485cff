"""Weight-only int8 for the LM (`--weights int8`, model/int8.py): the recipe, which weights, how
close to fp32, and the runtime that runs it."""

from __future__ import annotations

import pytest
import torch

from personaplex_demo.model.checkpoint import load_lm
from personaplex_demo.model.config import LMConfig, quantized_key
from personaplex_demo.model.int8 import Int8Linear, quantize_rows
from personaplex_demo.runtime.build import INT8_BANNER, RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.web.page import status_payload

from .lm_fixtures import real_lm_shapes, tiny_lm_file
from .support.int8 import lm_weight_bytes, quantize_loaded, weight_bytes

REAL_LM = real_lm_shapes()


def test_each_row_is_int8_with_its_own_scale_and_rounds_to_within_half_a_step():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]
    q, scales = quantize_rows(w, torch.float32)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    assert (q.abs().amax(dim=1) == 127).all()  # each row uses its whole range
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()


def test_the_transformer_layers_are_quantized_and_nothing_else():
    quantized = sorted(k for k in REAL_LM if quantized_key(k))
    assert len(quantized) == 32 * 4 + 6 * (2 + 2 * 16) + 16 and len(REAL_LM) == 475
    assert not [k for k in quantized if not k.startswith(("transformer.layers.", "depformer.layers.", "depformer_in."))]
    kept = [k for k in REAL_LM if "emb" in k or "norm" in k or k.startswith(("linears.", "text_linear"))]
    assert kept and not any(quantized_key(k) for k in kept)
    # About half the bf16 weights: the embeddings and the output heads stay.
    assert 0.5 < lm_weight_bytes(REAL_LM, "int8", 2) / lm_weight_bytes(REAL_LM, "dense", 2) < 0.55


def test_the_tiny_lm_in_int8_stays_close_to_fp32(tiny_repo):
    cfg = LMConfig.tiny()
    dense = load_lm(cfg, tiny_repo / "model.safetensors", torch.float32)
    int8 = load_lm(cfg, tiny_repo / "model.safetensors", torch.float32, weights="int8")
    assert isinstance(int8.transformer.layers[0].gating.linear_in, Int8Linear)
    assert int8.transformer.layers[0].self_attn.in_proj_weight.dtype == torch.int8
    assert int8.depformer.layers[0].self_attn.out_proj_scales.shape == (cfg.dep_q * cfg.depformer_dim,)
    assert weight_bytes(int8) < weight_bytes(dense)
    torch.manual_seed(0)
    x = torch.randn(3, 1, cfg.dim)
    kv = [m.new_kv(3, "cpu", torch.float32) for m in (dense, int8)]
    active = torch.ones(3, dtype=torch.bool)
    for _ in range(6):
        h = [m.temporal_step(x, k, active) for m, k in zip((dense, int8), kv, strict=True)]
    text = [m.text_logits(hh) for m, hh in zip((dense, int8), h, strict=True)]
    seen: list[list[torch.Tensor]] = [[], []]

    def choose(i):
        def pick(step, logits):
            seen[i].append(logits)
            return logits.argmax(-1)
        return pick

    forced, mask = torch.zeros(3, cfg.dep_q, dtype=torch.long), torch.zeros(3, cfg.dep_q, dtype=torch.bool)
    tok = text[0].argmax(-1)
    for i, (m, hh) in enumerate(zip((dense, int8), h, strict=True)):
        m.depformer_frame(hh, tok, forced, mask, cfg.dep_q, choose(i))
    for a, b in [(text[0], text[1]), *zip(seen[0], seen[1], strict=True)]:
        assert ((a - b).norm() / a.norm()).item() < 0.03
        assert torch.nn.functional.cosine_similarity(a, b).min().item() > 0.999


def test_a_runtime_with_int8_weights_says_so(tiny_cache_dir):
    runtime = build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir, weights="int8"))
    assert runtime.weights == "int8" and INT8_BANNER in runtime.banner
    assert runtime.engine.core.lm.transformer.layers[0].self_attn.in_proj_weight.dtype == torch.int8

    payload = status_payload(runtime, SlotPool(runtime.engine, PoolConfig()))
    assert payload["weights"] == "int8" and INT8_BANNER in payload["banner"]


def test_a_bf16_file_loads_as_int8_with_bf16_scales_and_stays_close_to_bf16():
    path = tiny_lm_file(torch.bfloat16)
    dense = load_lm(LMConfig.tiny(), path, torch.bfloat16)
    int8 = load_lm(LMConfig.tiny(), path, torch.bfloat16, weights="int8")
    attn = int8.transformer.layers[1].self_attn
    assert attn.in_proj_weight.dtype == torch.int8 and attn.in_proj_scales.dtype == torch.bfloat16
    assert int8.emb[0].weight.dtype == torch.bfloat16 and torch.equal(int8.emb[0].weight, dense.emb[0].weight)
    x = torch.randn(2, 1, LMConfig.tiny().dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    active = torch.ones(2, dtype=torch.bool)
    a, b = (m.text_logits(m.temporal_step(x, m.new_kv(2, "cpu", torch.bfloat16), active)) for m in (dense, int8))
    assert ((a - b).norm() / a.norm()).item() < 0.05


def test_quantizing_a_loaded_lm_in_place_matches_quantizing_while_loading(tiny_repo):
    cfg = LMConfig.tiny()
    loaded = load_lm(cfg, tiny_repo / "model.safetensors", torch.float32, weights="int8")
    later = load_lm(cfg, tiny_repo / "model.safetensors", torch.float32)
    assert quantize_loaded(later) == 92
    mine, theirs = loaded.state_dict(), later.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert isinstance(later.depformer_in[0], Int8Linear)


def test_int8_with_float16_is_refused_at_start_up():
    from personaplex_demo.runtime.build import check_placement

    with pytest.raises(ValueError, match="--weights int8 needs --dtype bfloat16 or float32"):
        check_placement("cpu", "float16", "int8")
    check_placement("cpu", "float32", "int8")


@pytest.mark.parametrize("bad", ["int4", "INT8 "])
def test_an_unknown_weights_choice_is_refused(tiny_repo, bad):
    with pytest.raises(ValueError, match="weights must be one of dense, int8"):
        load_lm(LMConfig.tiny(), tiny_repo / "model.safetensors", torch.float32, weights=bad)
