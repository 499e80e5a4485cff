"""Weight-only int8 for the LM's transformer layers (docs/model.md § Int8 weights): gpt-fast's recipe,
one scale per output row. Written out because the depformer slices its attention weights per step,
which a library's quantized tensor types do not offer. Which keys: `model.config.quantized_key`.
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

