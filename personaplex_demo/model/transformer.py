"""The streaming transformer used by Mimi and the LM: norms, interleaved RoPE, fused-QKV
attention over a ring KV cache, and one pre-norm residual layer (docs/model.md § Transformers).
Streaming state lives in `RingKV` objects owned by the caller, so one row can be reset alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import int8
from .ring import Attend, RingKV, RingLayer


class RMSNorm(nn.Module):
    """`rms_norm_f32`: computed in fp32, weight `alpha` of shape [1, 1, D]."""

    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel where the formula below is six (docs/model.md § Transformers).
            return F.rms_norm(x, (x.shape[-1],), self.alpha.view(-1), self.eps)
        # Same operation order as the reference, so fp32 results are bit-identical.
        x32 = x.float()
        var = self.eps + torch.mean(x32**2, dim=-1, keepdim=True)
        return (x32 * (self.alpha.float() * torch.rsqrt(var))).to(x.dtype)


class LayerScale(nn.Module):
    """A learnt per-channel scale of a residual branch (Mimi)."""

    def __init__(self, dim: int, init: float = 0.01):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def rope_angles(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The interleaved RoPE at `positions` [B, T] as two fp32 tables [B, T, 1, 1, D] for `rotate`:
    each pair's cos twice, and its sin as (-sin, +sin). Built once per forward for every layer."""
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    angles = positions.to(torch.float32)[:, :, None] * freqs  # [B, T, D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    B, T = positions.shape
    return (torch.stack([cos, cos], dim=-1).view(B, T, 1, 1, head_dim),
            torch.stack([-sin, sin], dim=-1).view(B, T, 1, 1, head_dim))


def rotate(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, T, ..., D] by `rope_angles`, in fp32:
    x * cos + swap(x) * (-sin, sin), the reference's pairwise form bit for bit (docs/model.md § Transformers)."""
    cos, sin = angles
    D = x.shape[-1]
    xf = x.float()
    swapped = xf.view(*x.shape[:-1], D // 2, 2).flip(-1).view(x.shape)
    return (xf * cos + swapped * sin).to(x.dtype)


class Attention(nn.Module):
    """Fused-QKV self-attention without biases over a ring KV cache; `steps` > 0 gives
    per-step weights (the depformer: `in_proj_weight` [steps * 3D, D], `out_proj` [steps * D, D])."""

    def __init__(self, dim: int, num_heads: int, steps: int = 0):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        mult = max(steps, 1)
        self.in_proj_weight = nn.Parameter(torch.empty(mult * 3 * dim, dim))
        self.out_proj = nn.Linear(dim, mult * dim, bias=False)
        # With int8 weights, their scales per output row (model/int8.py); None: plain weights.
        self.register_buffer("in_proj_scales", None)
        self.register_buffer("out_proj_scales", None)

    def forward(self, x: torch.Tensor, attend: Attend, angles: tuple[torch.Tensor, torch.Tensor] | None,
                cache: RingLayer, step: int | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; the new keys go into `cache` before the queries attend."""
        B, T, _ = x.shape
        qkv = self._project(x, self.in_proj_weight, self.in_proj_scales, step, 3 * self.dim)
        qkv = qkv.view(B, T, 3, self.num_heads, -1)
        if angles is None:
            q, new = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1:].permute(2, 0, 3, 1, 4)  # [2, B, H, T, Dh]
        else:
            q, k = rotate(qkv[:, :, :2], angles).transpose(1, 3).unbind(2)  # q and k in one go: [B, H, T, Dh]
            new = torch.stack([k, qkv[:, :, 2].transpose(1, 2)])
        keys, values = cache.update(new, attend)
        a = F.scaled_dot_product_attention(q, keys, values, attend.mask)
        a = a.transpose(1, 2).reshape(B, T, self.dim)
        return self._project(a, self.out_proj.weight, self.out_proj_scales, step, self.dim)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, step: int | None,
                 rows: int) -> torch.Tensor:
        """x @ W.T with W the whole weight, or with `step` its step-th block of `rows` rows."""
        if step is not None:
            weight = weight.view(-1, rows, self.dim)[step]
            scales = None if scales is None else scales.view(-1, rows)[step]
        return int8.linear(x, weight, scales)


class SwiGLU(nn.Module):
    """`linear_in` -> [gate | value]; silu(gate) * value -> `linear_out` (gate half first)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x)
        B, T, _ = h.shape
        h = h.view(B, T, 2, -1)
        return self.linear_out(F.silu(h[..., 0, :]) * h[..., 1, :])


class TransformerLayer(nn.Module):
    """The pre-norm residual block. Subclasses register `norm1`, `self_attn`, `norm2`,
    `layer_scale_1`, `layer_scale_2` (in their checkpoint's order) and define `feed_forward`."""

    norm1: nn.Module
    self_attn: Attention
    norm2: nn.Module
    layer_scale_1: nn.Module
    layer_scale_2: nn.Module

    def feed_forward(self, x: torch.Tensor, step: int | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, attend: Attend, angles: tuple[torch.Tensor, torch.Tensor] | None,
                cache: RingLayer, step: int | None = None) -> torch.Tensor:
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x), attend, angles, cache, step))
        return x + self.layer_scale_2(self.feed_forward(self.norm2(x), step))


class Transformer(nn.Module):
    """A stack of layers (`layers.N` in the checkpoints) sharing one RoPE and one ring KV cache."""

    def __init__(self, layers: Sequence[TransformerLayer], head_dim: int, max_period: float | None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head_dim = head_dim
        self.max_period = max_period  # None: no positional encoding (the depformer)

    def forward(self, x: torch.Tensor, attend: Attend, kv: RingKV, step: int | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D], writing the new keys into `kv` (see `RingKV.advance`)."""
        angles = None
        if self.max_period is not None and attend.positions is not None:
            # Computed once for all layers (every layer's ring holds the same positions).
            angles = rope_angles(attend.positions, self.head_dim, self.max_period)
        for layer, cache in zip(self.layers, kv.layers):
            x = layer(x, attend, angles, cache, step)
        return x
