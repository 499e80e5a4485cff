"""Helpers that build the golden tiny LM and its voices from the hash-v1 recipe."""

from __future__ import annotations

from dataclasses import fields, replace
from functools import cache
from pathlib import Path

import torch

from personaplex_demo.engine.prompt import VoiceTokens
from personaplex_demo.model.checkpoint import load_lm, meta_lm, write_hash_checkpoint
from personaplex_demo.model.config import LMConfig
from personaplex_demo.model.hashinit import hash_tensor

from .conftest import golden

LM_SEED = golden("lm-tiny.config.json")["weights"]["seed"]


def lm_config_from_kwargs(kwargs: dict) -> LMConfig:
    """Build from NVIDIA `LMModel` kwargs; unknown keys are architecture constants here."""
    picked = {f.name: kwargs[f.name] for f in fields(LMConfig) if f.name in kwargs}
    if "delays" in picked:
        picked["delays"] = tuple(picked["delays"])
    return LMConfig(**picked)


def tiny_lm_config(overrides: dict | None = None) -> LMConfig:
    cfg = lm_config_from_kwargs(golden("lm-tiny.config.json")["kwargs"])
    assert cfg == LMConfig.tiny()
    if overrides and "context" in overrides:
        cfg = replace(cfg, context=overrides["context"])
    return cfg



@cache
def tiny_lm_file(dtype: torch.dtype = torch.float32) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="pp-lm-")) / "model.safetensors"
    return write_hash_checkpoint(meta_lm(LMConfig.tiny()), path, "lm", LM_SEED, dtype)


def tiny_lm(overrides: dict | None = None, dtype: torch.dtype = torch.float32, weights: str = "dense"):
    return load_lm(tiny_lm_config(overrides), tiny_lm_file(), dtype, weights=weights)


def golden_voice(name: str, dtype: torch.dtype = torch.float32) -> VoiceTokens:
    spec = golden("lm-tiny.voices.json")["voices"][name]
    e = spec["embeddings"]
    emb = torch.from_numpy(hash_tensor(e["key"], e["seed"], e["shape"], e["offset"], e["scale"]))
    return VoiceTokens(name, emb.view(emb.shape[0], -1).to(dtype), torch.tensor(spec["cache"][0], dtype=torch.long))


def golden_persona(name: str) -> list[int]:
    return golden("lm-tiny.voices.json")["personas"][name]


def real_lm_shapes() -> dict[str, tuple[int, ...]]:
    """PersonaPlex-7B's LM checkpoint keys and their shapes, from the golden key list."""
    return {k: tuple(v["shape"]) for k, v in golden("personaplex-7b-v1.keys.json")["lm"]["tensors"].items()}
