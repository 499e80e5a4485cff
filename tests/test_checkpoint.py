"""Checkpoint layout and loader errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from personaplex_demo.errors import CheckpointError
from personaplex_demo.model.checkpoint import (
    expected_shapes,
    load_checkpoint,
    load_lm,
    meta_lm,
    meta_mimi,
    write_hash_checkpoint,
)
from personaplex_demo.model.config import LMConfig, MimiConfig

from .conftest import golden
from .lm_fixtures import tiny_lm_file

MANIFEST = golden("personaplex-7b-v1.keys.json")


def _manifest_shapes(part: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v["shape"]) for k, v in MANIFEST[part]["tensors"].items()}


def test_full_size_lm_on_meta_matches_the_real_manifest():
    lm = meta_lm(LMConfig())
    shapes = expected_shapes(lm)
    assert shapes == _manifest_shapes("lm")
    assert len(shapes) == 475
    assert sum(p.numel() for p in lm.parameters()) == 8_371_408_896
    assert all(p.is_meta for p in lm.parameters())


def test_full_size_mimi_on_meta_matches_the_real_manifest():
    assert expected_shapes(meta_mimi(MimiConfig())) == _manifest_shapes("mimi")


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    data = tiny_lm_file().read_bytes()
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_lm(LMConfig.tiny(), bad)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_lm(LMConfig.tiny(), tmp_path / "nope.safetensors")


def test_wrong_shapes_and_keys_are_named(tmp_path):
    state = {k: torch.zeros(s) for k, s in expected_shapes(meta_lm(LMConfig.tiny())).items()}
    state["text_linear.weight"] = torch.zeros(31999, 64)
    del state["out_norm.alpha"]
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as err:
        load_lm(LMConfig.tiny(), path)
    msg = str(err.value)
    assert str(path) in msg
    assert "missing key(s): out_norm.alpha" in msg
    assert "unexpected key(s): extra.weight" in msg
    assert "text_linear.weight is [31999, 64], expected [32000, 64]" in msg


def test_loader_casts_to_the_requested_dtype_without_random_init():
    lm = load_checkpoint(meta_lm(LMConfig.tiny()), tiny_lm_file(), torch.bfloat16)
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in lm.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_hash_checkpoint_holds_make_tensor_across_piece_boundaries(tmp_path, dtype):
    from safetensors import safe_open

    from .support.signals import make_tensor

    path = write_hash_checkpoint(meta_lm(LMConfig.tiny()), tmp_path / "model.safetensors", "lm", 1242, dtype,
                                 chunk=1000)  # tensors of up to 2 M elements: many pieces each
    shapes = expected_shapes(meta_lm(LMConfig.tiny()))
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(shapes) and f.metadata()["recipe"] == "hash-v1"
        for key, shape in shapes.items():
            t = f.get_tensor(key)
            assert t.dtype == dtype and tuple(t.shape) == shape
            assert torch.equal(t, torch.from_numpy(make_tensor("lm", key, shape, 1242)).to(dtype)), key
