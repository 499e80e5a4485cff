"""Int8 weight measurements for tests and benchmarks (docs/model.md § Int8 weights)."""

from __future__ import annotations

import math

import torch.nn as nn

from personaplex_demo.model.config import quantized_key
from personaplex_demo.model.int8 import attach_scales, quantize_rows


def lm_weight_bytes(shapes: dict[str, tuple[int, ...]], weights: str, itemsize: int) -> int:
    """Bytes of the LM's weights as loaded, from the checkpoint's keys and shapes: `itemsize` per
    element, but for int8 weights one byte per element plus a scale (`itemsize`) per row."""
    total = 0
    for key, shape in shapes.items():
        n = math.prod(shape)
        total += n + shape[0] * itemsize if weights == "int8" and quantized_key(key) else n * itemsize
    return total


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of the LM's parameters and buffers as loaded (int8 weights and their scales included)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*lm.parameters(), *lm.buffers()]}
    return sum(seen.values())


def quantize_loaded(lm: nn.Module) -> int:
    """Quantize an LM already loaded with dense weights, in place; how many tensors. The app
    quantizes while it reads the file instead (`load_checkpoint`); this is for measuring both
    kinds on one set of weights (bench/gpu_int8.py)."""
    lm.requires_grad_(False)  # an int8 parameter cannot require gradients
    keys = [k for k in lm.state_dict() if quantized_key(k)]
    for key in keys:  # one at a time, each dense tensor freed as its int8 one takes its place
        owner, _, name = key.rpartition(".")
        module = lm.get_submodule(owner)
        q, s = quantize_rows(getattr(module, name), getattr(module, name).dtype)
        setattr(module, name, nn.Parameter(q, requires_grad=False))
        attach_scales(lm, {key: s})
    return len(keys)
