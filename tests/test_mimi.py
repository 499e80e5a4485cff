"""Streaming Mimi against the golden fixtures (tests/golden/README.md §1, §2, §5, §7)."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_demo.model.config import MimiConfig
from personaplex_demo.model.mimi import Mimi

from .support.signals import make_tensor, mimi_input

GOLDEN = Path(__file__).parent / "golden"
PCM_ATOL = 1e-5


def _load(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="module")
def tiny_config() -> dict:
    return _load("mimi-tiny.config.json")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return _load("mimi-tiny.weights.json")


@pytest.fixture(scope="module")
def stream() -> dict:
    return _load("mimi-stream.json")


@pytest.fixture(scope="module")
def tiny_weights(tiny_config: dict, manifest: dict) -> dict[str, np.ndarray]:
    seed = tiny_config["weights"]["seed"]
    return {key: make_tensor("mimi", key, t["shape"], seed) for key, t in manifest["tensors"].items()}


def mimi_config_from_kwargs(kw: dict) -> MimiConfig:
    """Build from the reference `{seanet, quantizer, transformer, model}` kwargs."""
    s, q, t, m = kw["seanet"], kw["quantizer"], kw["transformer"], kw["model"]
    return MimiConfig(
        sample_rate=m["sample_rate"], frame_rate=m["frame_rate"], channels=s["channels"],
        n_filters=s["n_filters"], dimension=s["dimension"], ratios=tuple(s["ratios"]),
        kernel_size=s["kernel_size"], residual_kernel_size=s["residual_kernel_size"],
        last_kernel_size=s["last_kernel_size"], compress=s["compress"], transformer_d_model=t["d_model"],
        transformer_num_heads=t["num_heads"], transformer_num_layers=t["num_layers"],
        transformer_dim_feedforward=t["dim_feedforward"], transformer_context=t["context"],
        transformer_max_period=t["max_period"], quantizer_dimension=q["dimension"],
        quantizer_n_q=q["n_q"], quantizer_bins=q["bins"], num_codebooks=m["num_codebooks"],
    )


@pytest.fixture(scope="module")
def mimi(tiny_config: dict, tiny_weights: dict[str, np.ndarray]) -> Mimi:
    cfg = mimi_config_from_kwargs(tiny_config["kwargs"])
    assert cfg == MimiConfig.tiny()
    model = Mimi(cfg).eval()
    state_dict = {k: torch.from_numpy(v) for k, v in tiny_weights.items()}
    model.load_state_dict(state_dict, strict=True)
    return model


@pytest.fixture(scope="module")
def signal(stream: dict) -> np.ndarray:
    inp = stream["encode"]["input"]
    x = mimi_input(inp["n_frames"], inp["seed"])
    assert hashlib.sha256(x.astype("<f4").tobytes()).hexdigest() == inp["sha256"]
    return x


def _encode_run(model: Mimi, frames: np.ndarray) -> np.ndarray:
    state = model.init_state(1)
    out = [model.encode_step(torch.from_numpy(f)[None], state)[0] for f in frames]
    return torch.stack(out).numpy()


def _decode_run(model: Mimi, codes: np.ndarray) -> np.ndarray:
    state = model.init_state(1)
    out = [model.decode_step(torch.from_numpy(c)[None], state)[0] for c in codes]
    return torch.stack(out).numpy()


def test_hash_weights_match_manifest(tiny_weights: dict[str, np.ndarray], manifest: dict) -> None:
    assert len(tiny_weights) == manifest["n_tensors"] == 126
    for key, t in manifest["tensors"].items():
        v = tiny_weights[key]
        assert list(v.shape) == t["shape"], key
        assert v.dtype == np.float32, key
        assert hashlib.sha256(np.ascontiguousarray(v).astype("<f4").tobytes()).hexdigest() == t["sha256"], key


def test_tiny_state_dict_layout(mimi: Mimi, manifest: dict) -> None:
    got = {k: list(v.shape) for k, v in mimi.state_dict().items()}
    assert got == {k: t["shape"] for k, t in manifest["tensors"].items()}


def test_golden_encode(mimi: Mimi, signal: np.ndarray, stream: dict) -> None:
    codes = _encode_run(mimi, signal)
    expected = np.array(stream["encode"]["codes"], dtype=np.int64)
    assert codes.shape == expected.shape == (160, 8)
    bad = np.nonzero((codes != expected).any(axis=1))[0]
    assert bad.size == 0, f"codes differ from frame {bad[0]} on ({bad.size} frames)"


def test_golden_decode(mimi: Mimi, stream: dict) -> None:
    dec = stream["decode"]
    codes = np.array(dec["codes"], dtype=np.int64)
    expected = np.stack([np.frombuffer(base64.b64decode(p), dtype="<f4") for p in dec["pcm"]])
    assert list(expected.shape) == dec["all"]["shape"]
    pcm = _decode_run(mimi, codes)
    assert pcm.shape == expected.shape and pcm.dtype == np.float32
    err = np.abs(pcm - expected).max(axis=1)
    assert err.max() <= PCM_ATOL, f"max |dpcm| {err.max():.3g} at frame {int(err.argmax())}"


def test_per_row_reset(mimi: Mimi, signal: np.ndarray) -> None:
    """B = 2; row 1 is reset mid-stream (after its rings have wrapped) and must then match a fresh
    B = 1 stream, while row 0 must match its own uninterrupted run. The run continues past a
    second wrap of row 1's rings (tiny rings hold 32 frames)."""
    n, reset_at = 80, 40
    sig0 = signal[:n]
    sig1 = signal[n:2 * n]
    rng = np.random.default_rng(0)
    codes0 = rng.integers(0, mimi.cfg.quantizer_bins, size=(n, 8))
    codes1 = rng.integers(0, mimi.cfg.quantizer_bins, size=(n, 8))

    state = mimi.init_state(2)
    enc, dec = [], []
    for f in range(n):
        if f == reset_at:
            mimi.reset_rows(state, [1])
        pcm = torch.from_numpy(np.stack([sig0[f], sig1[f]]))
        enc.append(mimi.encode_step(pcm, state).numpy())
        codes = torch.from_numpy(np.stack([codes0[f], codes1[f]]))
        dec.append(mimi.decode_step(codes, state).numpy())
    enc_b, dec_b = np.stack(enc), np.stack(dec)  # [n, 2, 8], [n, 2, 1920]

    np.testing.assert_array_equal(enc_b[:, 0], _encode_run(mimi, sig0))
    np.testing.assert_array_equal(enc_b[reset_at:, 1], _encode_run(mimi, sig1[reset_at:]))
    np.testing.assert_allclose(dec_b[:, 0], _decode_run(mimi, codes0), rtol=0, atol=PCM_ATOL)
    np.testing.assert_allclose(dec_b[reset_at:, 1], _decode_run(mimi, codes1[reset_at:]),
                               rtol=0, atol=PCM_ATOL)
    # The reset row really did change: its pre-reset history differs from a fresh start.
    assert not np.array_equal(enc_b[:reset_at, 1], _encode_run(mimi, sig1[reset_at:2 * reset_at]))


def test_separate_encoder_decoder_reset(mimi: Mimi, signal: np.ndarray) -> None:
    """Resetting the encoder's rows leaves the decoder state alone, and the other way round."""
    state = mimi.init_state(2)
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
    for f in range(3):
        mimi.encode_step(torch.from_numpy(signal[f:f + 2]), state)
        mimi.decode_step(codes, state)
    dec_end = state.decoder.transformer.end.clone()
    tails = [s.tail.clone() for s in state.decoder.seanet if hasattr(s, "tail")]
    state.encoder.reset_rows(torch.tensor([False, True]))
    assert state.encoder.transformer.end.tolist() == [6, 0]
    assert state.encoder.downsample.fresh.tolist() == [False, True]
    assert torch.equal(state.decoder.transformer.end, dec_end)
    assert all(torch.equal(a, s.tail) for a, s in
               zip(tails, [s for s in state.decoder.seanet if hasattr(s, "tail")]))
    state.decoder.reset_rows(torch.tensor([True, False]))
    assert state.decoder.transformer.end.tolist() == [0, 6]
    assert not state.decoder.upsample.tail[0].any()


def test_full_size_layout_on_meta() -> None:
    expected = _load("personaplex-7b-v1.keys.json")["mimi"]["tensors"]
    assert len(expected) == 318
    with torch.device("meta"):
        model = Mimi(MimiConfig())
        state = model.init_state(2)
    sd = model.state_dict()
    assert all(v.is_meta for v in sd.values())
    assert list(sd) == list(expected)
    for key, t in expected.items():
        assert list(sd[key].shape) == t["shape"], key
    assert state.encoder.transformer.kv.shape == (8, 2, 2, 8, 250, 64)


def test_meta_build_then_assign_load(tiny_weights: dict[str, np.ndarray], signal: np.ndarray,
                                     stream: dict) -> None:
    """The checkpoint loader's path: build on meta, then assign the file's tensors."""
    with torch.device("meta"):
        model = Mimi(MimiConfig.tiny())
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tiny_weights.items()},
                          strict=True, assign=True)
    model.eval().requires_grad_(False)
    n = 8
    np.testing.assert_array_equal(_encode_run(model, signal[:n]),
                                  np.array(stream["encode"]["codes"][:n]))
    # The cached code vectors follow an in-place change of the codebook buffers.
    cb = model.quantizer.rvq_first.vq.layers[0]._codebook
    before = cb.embedding.clone()
    cb.cluster_usage.mul_(2.0)
    torch.testing.assert_close(cb.embedding, before / 2.0, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_transposed_conv_matmul_path_equals_the_conv(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """The matmul fast path of a streaming transposed conv gives the conv's output, carry included."""
    import personaplex_demo.model.seanet as seanet_module
    from personaplex_demo.model.seanet import StreamingConvTranspose1d

    torch.manual_seed(0)
    layer = StreamingConvTranspose1d(24, 12, kernel_size=10, stride=5, bias=bias)
    assert layer.matmul_ok
    x = torch.randn(3, 24, 12)
    whole = torch.nn.functional.conv_transpose1d(x, layer.convtr.convtr.weight, layer.convtr.convtr.bias,
                                                 stride=5)[..., : 12 * 5]
    outs = {}
    for name, max_steps in (("matmul", 4), ("conv", 0)):
        monkeypatch.setattr(seanet_module, "MATMUL_MAX_STEPS", max_steps)
        state = layer.init_state(3, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            outs[name] = torch.cat([layer.step(x[..., i: i + 2], state) for i in range(0, 12, 2)], dim=-1)
    torch.testing.assert_close(outs["matmul"], whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(outs["conv"], whole, rtol=0, atol=1e-5)
