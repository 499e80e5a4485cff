"""Weight-only int8 for the LM's transformer layers (docs/model.md § Int8 weights).

Each weight matrix W [out, in] is stored as int8 with one scale per output row:
scale = max |W[row]| / 127, q = round(W / scale). A layer computes x @ (q * scale).T as
`F.linear(x, q.to(x.dtype)) * scale`: the activations stay in the model dtype, only the weights
shrink (to about half of bf16). This is gpt-fast's int8 recipe, written out here because the
depformer slices its attention weights per step (`Attention`'s views), which a library's
quantized tensor types do not offer (docs/design-notes.md § Int8 weights).

Quantized (`model.config.quantized_key`): every matrix of the temporal transformer's and the
depformer's layers (attention in and out, feed-forward in and out) and the depformer's input
projections. Embeddings, norms, the output heads and Mimi keep the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ROWS_AT_ONCE = 1024  # rows rounded together: the fp32 working copies stay a few MB


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (int8 [out, in], scales [out] in `dtype`), one symmetric scale per row,
    computed in fp32 whatever the file's dtype, a block of rows at a time."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], ROWS_AT_ONCE):
        block = w[start:start + ROWS_AT_ONCE].to(torch.float32, copy=True)  # rounded in place below
        s = scales[start:start + ROWS_AT_ONCE]
        torch.amax(block.abs(), dim=1, out=s)
        s.clamp_(min=1e-12).div_(127.0)
        q[start:start + ROWS_AT_ONCE] = block.div_(s[:, None]).round_().clamp_(-127, 127)
    return q, scales.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T, where W is `weight`, or `weight * scales` per row when it is int8."""
    if scales is None:
        return F.linear(x, weight)
    return F.linear(x, weight.to(x.dtype)) * scales


class Int8Linear(nn.Module):
    """A bias-free `nn.Linear` with int8 weights and a scale per output row."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scales)


def attach_scales(lm: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Give the loaded int8 weights (`quantized_key` keys, already int8 in `lm`) their scales:
    the attention modules keep theirs beside their weights (their per-step views slice both); the
    plain linear layers become `Int8Linear`s."""
    for key, s in scales.items():
        owner_name, _, leaf = key.rpartition(".")
        if leaf == "in_proj_weight":
            lm.get_submodule(owner_name).in_proj_scales = s
        elif owner_name.endswith("self_attn.out_proj"):
            lm.get_submodule(owner_name.removesuffix(".out_proj")).out_proj_scales = s
        else:
            parent_name, _, child = owner_name.rpartition(".")
            parent = lm.get_submodule(parent_name)
            setattr(parent, child, Int8Linear(getattr(parent, child).weight, s))


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of the LM's parameters and buffers as loaded (int8 weights and their scales included)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*lm.parameters(), *lm.buffers()]}
    return sum(seen.values())


def quantize_loaded(lm: nn.Module) -> int:
    """Quantize an LM already loaded with dense weights, in place; how many tensors. The app
    quantizes while it reads the file instead (`load_checkpoint`); this is for measuring both
    kinds on one set of weights (bench/gpu_int8.py)."""
    from .config import quantized_key

    lm.requires_grad_(False)  # an int8 parameter cannot require gradients
    keys = [k for k in lm.state_dict() if quantized_key(k)]
    for key in keys:  # one at a time, each dense tensor freed as its int8 one takes its place
        owner, _, name = key.rpartition(".")
        module = lm.get_submodule(owner)
        q, s = quantize_rows(getattr(module, name), getattr(module, name).dtype)
        setattr(module, name, nn.Parameter(q, requires_grad=False))
        attach_scales(lm, {key: s})
    return len(keys)
