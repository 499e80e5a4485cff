"""Transformer pieces of the PersonaPlex LM: RMSNorm, interleaved RoPE, a ring KV cache with
per-row offsets, attention and the SwiGLU feed-forward (spec §B, §C, §J.2-4, §J.10).

Streaming state lives in `RingKV` objects owned by the caller, not in the modules, so that
one batch row can be reset or overwritten without touching the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """`rms_norm_f32`: computed in fp32 with eps 1e-8, weight `alpha` of shape [1, 1, D]."""

    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as the reference, so fp32 results are bit-identical.
        x32 = x.float()
        var = self.eps + torch.mean(x32**2, dim=-1, keepdim=True)
        return (x32 * (self.alpha.float() * torch.rsqrt(var))).to(x.dtype)


def rope_angles(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D/2] of the interleaved RoPE at `positions` [B, T], in fp32."""
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    ts = positions.to(torch.float32)[:, None, :, None]  # [B, 1, T, 1]
    return torch.cos(freqs * ts), torch.sin(freqs * ts)


def rotate(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, H, T, D] by `rope_angles`, in fp32."""
    rotr, roti = angles
    D = x.shape[-1]
    x = x.view(*x.shape[:-1], D // 2, 2)
    xr, xi = x[..., 0].float(), x[..., 1].float()
    out = torch.stack([(xr * rotr - xi * roti).to(x.dtype), (xr * roti + xi * rotr).to(x.dtype)], dim=-1)
    return out.view(*out.shape[:-2], D)


@dataclass
class RingKV:
    """Ring KV cache of one attention layer, with an end offset per batch row.

    keys/values: [B, H, C, Dh]; end: [B] long, the number of keys ever written to the row.
    Key j of a row lives at index j % C. Positions follow NVIDIA's rule (`delta <= 0`): once a
    row has wrapped, the slot just after the newest key counts as a future position, so a query
    sees C - 1 keys (spec §B "Streaming KV ring", §J.10). Kept for token parity.
    """

    keys: torch.Tensor
    values: torch.Tensor
    end: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, head_dim: int,
              device: torch.device | str, dtype: torch.dtype) -> RingKV:
        shape = (batch, heads, capacity, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(batch, device=device, dtype=torch.long))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Forget every key of the given rows (bool mask [B]); stale slots are masked as `idx >= end`."""
        self.end.masked_fill_(rows, 0)

    def append(self, k: torch.Tensor, v: torch.Tensor, active: torch.Tensor) -> None:
        """Write one key per row at `end % C` and advance `end`, only where `active` [B] is true."""
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)
        idx = self.end % self.capacity
        keep = active.view(B, 1, 1)
        self.keys[rows, :, idx] = torch.where(keep, k[:, :, 0], self.keys[rows, :, idx])
        self.values[rows, :, idx] = torch.where(keep, v[:, :, 0], self.values[rows, :, idx])
        self.end += active.long()

    def positions(self, visible: int | None = None) -> torch.Tensor:
        """Stream position of every slot (of the first `visible` slots), -1 where empty: [B, C]."""
        C = self.capacity
        end = self.end.view(-1, 1)
        idx = torch.arange(C if visible is None else visible, device=end.device).view(1, -1)
        delta = idx - end % C
        pos = torch.where(delta <= 0, end + delta, end + delta - C)
        return torch.where(idx >= end, torch.full_like(pos, -1), pos)

    def load_row(self, row: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Install a prefix computed elsewhere: k, v [H, length, Dh] for positions 0..length-1."""
        C = self.capacity
        first = max(0, length - C)
        idx = torch.arange(first, length, device=self.keys.device) % C
        self.keys[row, :, idx] = k[:, first:length].to(self.keys.dtype)
        self.values[row, :, idx] = v[:, first:length].to(self.values.dtype)
        self.end[row] = length


def step_attention_mask(kv: RingKV, query_pos: torch.Tensor, context: int,
                        visible: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, 1, C] (or [B, 1, 1, visible]: the first slots only) for one query per
    row at `query_pos` [B]."""
    pos_k = kv.positions(visible)
    delta = query_pos.view(-1, 1) - pos_k
    mask = (pos_k >= 0) & (delta >= 0) & (delta < context)
    return mask[:, None, None, :]


def prefill_attention_mask(length: int, capacity: int, context: int, device: torch.device) -> torch.Tensor:
    """Causal mask [1, 1, L, L] of a parallel forward that equals stepping a fresh ring of
    `capacity` one key at a time: query q sees key p iff 0 <= q - p <= capacity - 2 (the ring
    rule hides the oldest slot once wrapped) and q - p < context."""
    q = torch.arange(length, device=device).view(-1, 1)
    p = torch.arange(length, device=device).view(1, -1)
    d = q - p
    return ((d >= 0) & (d <= capacity - 2) & (d < context))[None, None]


class Attention(nn.Module):
    """Fused-QKV causal self-attention without biases; `steps` > 0 gives per-step weights
    (the depformer: `in_proj_weight` [steps * 3D, D], `out_proj` [steps * D, D])."""

    def __init__(self, dim: int, num_heads: int, steps: int = 0):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        mult = max(steps, 1)
        self.in_proj_weight = nn.Parameter(torch.empty(mult * 3 * dim, dim))
        self.out_proj = nn.Linear(dim, mult * dim, bias=False)

    def qkv(self, x: torch.Tensor, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q, k, v [B, H, T, Dh]."""
        w = self.in_proj_weight if step is None else self.in_proj_weight.view(-1, 3 * self.dim, self.dim)[step]
        B, T, _ = x.shape
        qkv = F.linear(x, w).view(B, T, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return q, k, v

    def project_out(self, x: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """x [B, H, T, Dh] -> [B, T, D]."""
        B, H, T, Dh = x.shape
        x = x.transpose(1, 2).reshape(B, T, H * Dh)
        w = self.out_proj.weight if step is None else self.out_proj.weight.view(-1, self.dim, self.dim)[step]
        return F.linear(x, w)


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
