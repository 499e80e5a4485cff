"""Native streaming Mimi codec: 24 kHz PCM <-> 12.5 Hz frames of 8 RVQ codes (spec §D).

One call of `Mimi.encode_step` turns one 80 ms frame (1920 samples) per batch row into 8 codes,
one call of `Mimi.decode_step` turns 8 codes per row back into 1920 samples. Streaming state is
explicit: `Mimi.init_state(B)` returns tensors with a leading batch dimension, and any subset of
rows can be reset to a fresh stream without touching the others (`Mimi.reset_rows`).

Module and parameter names reproduce the official checkpoint layout
(`tokenizer-e351c8d8-checkpoint125.safetensors`, 318 keys), so the file loads with
`load_state_dict(strict=True)`. The numerics follow the reference operation order (NVIDIA's moshi
fork), including its ring-KV position rule (spec §J.9, §J.10).

Per frame:
    encode  pcm [B, 1, 1920] -> SEANet encoder [B, D, 2] (25 Hz) -> transformer -> downsample
            [B, D, 1] (12.5 Hz) -> split RVQ -> codes [B, 8]
    decode  codes [B, 8] -> RVQ lookup [B, D, 1] -> upsample [B, D, 2] -> transformer
            -> SEANet decoder -> pcm [B, 1920]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MimiConfig

logger = logging.getLogger(__name__)

Rows = Tensor | Sequence[int] | Sequence[bool]


# --------------------------------------------------------------------------------------------
# Streaming state
# --------------------------------------------------------------------------------------------


@dataclass
class ConvState:
    """Left context of one causal conv: the last `k_eff - stride` input samples of each row."""

    carry: Tensor  # [B, C_in, k_eff - stride], zeros for a fresh row
    fresh: Tensor | None = None  # [B] bool, only for replicate padding: row has not been fed yet

    def reset_rows(self, mask: Tensor) -> None:
        self.carry.masked_fill_(mask[:, None, None], 0.0)
        if self.fresh is not None:
            self.fresh.masked_fill_(mask, True)


@dataclass
class ConvTrState:
    """Overlap tail of one transposed conv, stored without the bias (it is added once per call)."""

    tail: Tensor  # [B, C_out, k - stride]

    def reset_rows(self, mask: Tensor) -> None:
        self.tail.masked_fill_(mask[:, None, None], 0.0)


@dataclass
class TransformerState:
    """Ring KV caches of all layers and the per-row step counter."""

    kv: Tensor  # [L, 2, B, H, capacity, head_dim]
    end: Tensor  # [B] int64: steps written since the row's last reset (= next RoPE position)

    def reset_rows(self, mask: Tensor) -> None:
        # end = 0 alone would hide the stale slots (idx >= end is masked); zeroing them as well
        # keeps a row that once produced non-finite values from leaking them through 0 * NaN.
        self.kv.masked_fill_(mask[None, None, :, None, None, None], 0.0)
        self.end.masked_fill_(mask, 0)


@dataclass
class EncoderState:
    seanet: list[ConvState]  # one per conv of the SEANet encoder, in forward order
    transformer: TransformerState
    downsample: ConvState  # replicate-padded on each row's first frame

    def reset_rows(self, mask: Tensor) -> None:
        for s in self.seanet:
            s.reset_rows(mask)
        self.transformer.reset_rows(mask)
        self.downsample.reset_rows(mask)


@dataclass
class DecoderState:
    upsample: ConvTrState
    transformer: TransformerState
    seanet: list[ConvState | ConvTrState]  # one per (transposed) conv of the decoder, in order

    def reset_rows(self, mask: Tensor) -> None:
        self.upsample.reset_rows(mask)
        self.transformer.reset_rows(mask)
        for s in self.seanet:
            s.reset_rows(mask)


@dataclass
class MimiState:
    """Encoder and decoder streaming state; the two are fully independent."""

    encoder: EncoderState
    decoder: DecoderState

    @property
    def batch_size(self) -> int:
        return self.encoder.transformer.end.shape[0]


def _row_mask(rows: Rows, batch_size: int, device: torch.device) -> Tensor:
    """A bool mask [B] from a bool mask or a list/tensor of row indices."""
    if isinstance(rows, Tensor):
        if rows.dtype == torch.bool:
            assert rows.shape == (batch_size,), (rows.shape, batch_size)
            return rows.to(device)
        idx = rows.to(device=device, dtype=torch.long).reshape(-1)
    else:
        rows = list(rows)
        if rows and all(isinstance(r, bool) for r in rows):
            assert len(rows) == batch_size, (len(rows), batch_size)
            return torch.tensor(rows, dtype=torch.bool, device=device)
        idx = torch.tensor(rows, dtype=torch.long, device=device)
    return torch.zeros(batch_size, dtype=torch.bool, device=device).index_fill_(0, idx, True)


# --------------------------------------------------------------------------------------------
# Causal convolutions
# --------------------------------------------------------------------------------------------


class NormConv1d(nn.Module):
    """Holds the conv. The checkpoint was trained with weight norm, folded before release; the
    wrapper level survives in the key names (`….conv.conv.weight`)."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.conv = conv


class NormConvTranspose1d(nn.Module):
    """Same as `NormConv1d` for transposed convs (`….convtr.convtr.weight`)."""

    def __init__(self, convtr: nn.ConvTranspose1d):
        super().__init__()
        self.convtr = convtr


class StreamingConv1d(nn.Module):
    """Causal conv1d fed chunk by chunk: y = conv(cat(carry, x)), carry = last k_eff - stride inputs.

    A fresh row's carry is zeros, which is exactly the reference's constant left padding. With
    `replicate=True` (the 25 -> 12.5 Hz downsample) a fresh row's left context is instead copies
    of its first input frame. Chunk lengths must be multiples of the stride (always true in Mimi),
    so every chunk is consumed completely.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True, replicate: bool = False):
        super().__init__()
        self.conv = NormConv1d(nn.Conv1d(in_channels, out_channels, kernel_size, stride,
                                         dilation=dilation, groups=groups, bias=bias))
        self.in_channels = in_channels
        self.stride = stride
        self.context = (kernel_size - 1) * dilation + 1 - stride  # samples carried between calls
        self.replicate = replicate

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvState:
        carry = torch.zeros(batch_size, self.in_channels, self.context, device=device, dtype=dtype)
        fresh = torch.ones(batch_size, dtype=torch.bool, device=device) if self.replicate else None
        return ConvState(carry, fresh)

    def step(self, x: Tensor, state: ConvState) -> Tensor:
        # x: [B, C_in, T] -> [B, C_out, T // stride]
        assert x.shape[-1] % self.stride == 0, (x.shape, self.stride)
        conv = self.conv.conv
        if self.context == 0:
            return conv(x)
        carry = state.carry
        if state.fresh is not None:
            first = x[..., :1].expand(-1, -1, self.context)
            carry = torch.where(state.fresh[:, None, None], first, carry)
            state.fresh.fill_(False)
        x = torch.cat([carry, x], dim=-1)  # [B, C_in, context + T]
        state.carry.copy_(x[..., x.shape[-1] - self.context:])
        return conv(x)


# Up to this many input steps per call, a transposed conv with kernel = 2 * stride runs as a
# matmul (see `_step_matmul`); longer inputs are faster through PyTorch's conv.
MATMUL_MAX_STEPS = 4


class StreamingConvTranspose1d(nn.Module):
    """Causal transposed conv fed chunk by chunk.

    The last k - stride outputs of a call still receive contributions from the next input, so
    they are held back: y[:, :, :P] += tail; tail = y[:, :, -P:] - bias; emit y[:, :, :-P].
    The tail is kept without the bias because the next call's output already carries it.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 groups: int = 1, bias: bool = True):
        super().__init__()
        self.convtr = NormConvTranspose1d(nn.ConvTranspose1d(in_channels, out_channels, kernel_size,
                                                             stride, groups=groups, bias=bias))
        self.out_channels = out_channels
        self.stride = stride
        self.overlap = kernel_size - stride
        self.matmul_ok = groups == 1 and kernel_size == 2 * stride

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvTrState:
        return ConvTrState(torch.zeros(batch_size, self.out_channels, self.overlap,
                                       device=device, dtype=dtype))

    def step(self, x: Tensor, state: ConvTrState) -> Tensor:
        # x: [B, C_in, T] -> [B, C_out, T * stride]
        if self.matmul_ok and x.shape[-1] <= MATMUL_MAX_STEPS:
            return self._step_matmul(x, state)
        convtr = self.convtr.convtr
        y = convtr(x)  # [B, C_out, T * stride + P]
        p = self.overlap
        if p == 0:
            return y
        y[..., :p] += state.tail
        tail = y[..., y.shape[-1] - p:]
        if convtr.bias is not None:
            tail = tail - convtr.bias[:, None]
        state.tail.copy_(tail)
        return y[..., : y.shape[-1] - p]

    def _step_matmul(self, x: Tensor, state: ConvTrState) -> Tensor:
        """The same transposed conv as one matmul, for kernel = 2 * stride and few input steps.

        Each input step t yields 2 * stride outputs: the first half lands on its own block of
        `stride` samples, the second half on the next block. On the CPU, PyTorch runs a transposed
        conv with a short input through a slow generic kernel; the decoder's first one (1024 ->
        512 channels, kernel 16, 2 steps per frame) costs several times this matmul."""
        convtr = self.convtr.convtr
        B, c_in, T = x.shape
        s, c_out = self.stride, self.out_channels
        z = torch.mm(x.transpose(1, 2).reshape(B * T, c_in), convtr.weight.reshape(c_in, c_out * 2 * s))
        z = z.view(B, T, c_out, 2, s)
        head, spill = z[:, :, :, 0], z[:, :, :, 1]  # [B, T, C_out, s] each
        prev = torch.cat([state.tail[:, None], spill[:, : T - 1]], dim=1)  # the previous step's spill
        state.tail.copy_(spill[:, T - 1])
        y = (head + prev).permute(0, 2, 1, 3).reshape(B, c_out, T * s)
        if convtr.bias is not None:
            y = y + convtr.bias[:, None]
        return y


_StreamingConv = (StreamingConv1d, StreamingConvTranspose1d)


def _init_conv_states(module: nn.Module, batch_size: int, device: torch.device,
                      dtype: torch.dtype) -> list[ConvState | ConvTrState]:
    # modules() walks registration order, which is the forward order in these Sequentials.
    return [m.init_state(batch_size, device, dtype) for m in module.modules()
            if isinstance(m, _StreamingConv)]


def _run_layers(layers: nn.Sequential, x: Tensor, states: Iterator) -> Tensor:
    """Runs ELUs, streaming convs and residual units in order, each conv taking the next state."""
    for layer in layers:
        if isinstance(layer, _StreamingConv):
            x = layer.step(x, next(states))
        elif isinstance(layer, ResidualUnit):
            x = layer.step(x, states)
        else:
            x = layer(x)
    return x


# --------------------------------------------------------------------------------------------
# SEANet encoder / decoder
# --------------------------------------------------------------------------------------------


class ResidualUnit(nn.Module):
    """x + conv1x1(elu(conv_k3(elu(x)))), the identity skip ("true skip")."""

    def __init__(self, dim: int, kernel_size: int, dilation: int, compress: int):
        super().__init__()
        hidden = dim // compress
        self.block = nn.Sequential(
            nn.ELU(alpha=1.0),
            StreamingConv1d(dim, hidden, kernel_size, dilation=dilation),
            nn.ELU(alpha=1.0),
            StreamingConv1d(hidden, dim, 1),
        )

    def step(self, x: Tensor, states: Iterator) -> Tensor:
        return x + _run_layers(self.block, x, states)


class SEANetEncoder(nn.Module):
    """[B, 1, T] -> [B, dimension, T / hop]; strides are the ratios reversed (4, 5, 6, 8)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        nf = cfg.n_filters
        layers: list[nn.Module] = [StreamingConv1d(cfg.channels, nf, cfg.kernel_size)]
        mult = 1
        for ratio in reversed(cfg.ratios):
            # Mimi has one residual unit per stage (n_residual_layers = 1, dilation base**0).
            layers += [
                ResidualUnit(mult * nf, cfg.residual_kernel_size, 1, cfg.compress),
                nn.ELU(alpha=1.0),
                StreamingConv1d(mult * nf, 2 * mult * nf, 2 * ratio, stride=ratio),
            ]
            mult *= 2
        layers += [nn.ELU(alpha=1.0), StreamingConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> list[ConvState]:
        return _init_conv_states(self.model, batch_size, device, dtype)  # type: ignore[return-value]

    def step(self, x: Tensor, states: list[ConvState]) -> Tensor:
        return _run_layers(self.model, x, iter(states))


class SEANetDecoder(nn.Module):
    """[B, dimension, T] -> [B, 1, T * hop]; no output activation."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        nf = cfg.n_filters
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [StreamingConv1d(cfg.dimension, mult * nf, cfg.kernel_size)]
        for ratio in cfg.ratios:
            layers += [
                nn.ELU(alpha=1.0),
                StreamingConvTranspose1d(mult * nf, mult * nf // 2, 2 * ratio, stride=ratio),
                ResidualUnit(mult * nf // 2, cfg.residual_kernel_size, 1, cfg.compress),
            ]
            mult //= 2
        layers += [nn.ELU(alpha=1.0), StreamingConv1d(nf, cfg.channels, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)

    def init_state(self, batch_size: int, device: torch.device,
                   dtype: torch.dtype) -> list[ConvState | ConvTrState]:
        return _init_conv_states(self.model, batch_size, device, dtype)

    def step(self, x: Tensor, states: list[ConvState | ConvTrState]) -> Tensor:
        return _run_layers(self.model, x, iter(states))


# --------------------------------------------------------------------------------------------
# Streaming transformer (8 layers, ring KV of `context` steps, RoPE)
# --------------------------------------------------------------------------------------------


def rope_angles(start: Tensor, steps: int, head_dim: int, max_period: float) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, T, head_dim/2] in fp32 at positions start[b] + t (spec §B RoPE)."""
    ds = torch.arange(head_dim // 2, device=start.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    ts = start.float()[:, None] + torch.arange(steps, device=start.device, dtype=torch.float32)
    angles = freqs * ts[:, None, :, None]  # [B, 1, T, head_dim/2]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates interleaved pairs (x[2i], x[2i+1]) as complex numbers; x: [B, H, T, head_dim]."""
    *dims, d = x.shape
    pairs = x.view(*dims, d // 2, 2)
    xr, xi = pairs[..., 0].float(), pairs[..., 1].float()
    out_r = xr * cos - xi * sin
    out_i = xr * sin + xi * cos
    return torch.stack([out_r.to(x.dtype), out_i.to(x.dtype)], dim=-1).view(*dims, d)


class StreamingMultiheadAttention(nn.Module):
    """Causal self-attention over a ring KV cache; fused Q|K|V projection, no biases."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.in_proj_weight = nn.Linear(d_model, 3 * d_model, bias=False).weight  # [3D, D]
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def step(self, x: Tensor, kv: Tensor, write_idx: Tensor, mask: Tensor,
             cos: Tensor, sin: Tensor) -> Tensor:
        # x: [B, T, D]; kv: this layer's [2, B, H, cap, hd]; write_idx: [B, T]; mask: [B, 1, T, cap]
        B, T, D = x.shape
        qkv = F.linear(x, self.in_proj_weight).view(B, T, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = write_idx[:, None, :, None].expand(B, self.num_heads, T, self.head_dim)
        kv[0].scatter_(2, idx, k)
        kv[1].scatter_(2, idx, v)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)  # [B, H, T, hd]
        return self.out_proj(y.transpose(1, 2).reshape(B, T, D))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float = 0.01):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-norm layer: x += ls1 * attn(LN1(x)); x += ls2 * linear2(gelu(linear1(LN2(x))))."""

    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        self.layer_scale_1 = LayerScale(d_model)
        self.layer_scale_2 = LayerScale(d_model)

    def step(self, x: Tensor, kv: Tensor, write_idx: Tensor, mask: Tensor,
             cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.layer_scale_1(self.self_attn.step(self.norm1(x), kv, write_idx, mask, cos, sin))
        return x + self.layer_scale_2(self.linear2(F.gelu(self.linear1(self.norm2(x)))))


class StreamingTransformer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        d = cfg.transformer_d_model
        self.num_heads = cfg.transformer_num_heads
        self.head_dim = d // self.num_heads
        self.context = cfg.transformer_context  # attention window, and the ring's capacity
        self.max_period = cfg.transformer_max_period
        self.layers = nn.ModuleList(
            TransformerLayer(d, self.num_heads, cfg.transformer_dim_feedforward)
            for _ in range(cfg.transformer_num_layers))

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> TransformerState:
        kv = torch.zeros(len(self.layers), 2, batch_size, self.num_heads, self.context, self.head_dim,
                         device=device, dtype=dtype)
        return TransformerState(kv, torch.zeros(batch_size, dtype=torch.long, device=device))

    def _ring_mask(self, start: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Write slots [B, T] and attention mask [B, 1, T, cap] for T new steps of each row.

        Slot positions follow NVIDIA's RingKVCache exactly, including `delta <= 0`: once a row's
        ring has wrapped, the slot right after the newest key reads as a future position, so each
        query sees cap - 1 keys (spec §B, §J.10). Needed for bit parity with the reference.
        """
        cap = self.context
        pos_q = start[:, None] + torch.arange(steps, device=start.device)  # [B, T]
        end = (start + steps)[:, None]  # [B, 1], after this call's writes
        idx = torch.arange(cap, device=start.device)  # [cap]
        delta = idx - end % cap
        pos_k = torch.where(delta <= 0, end + delta, end + delta - cap)
        pos_k = torch.where(idx >= end, torch.full_like(pos_k, -1), pos_k)  # [B, cap]
        dist = pos_q[:, :, None] - pos_k[:, None, :]  # [B, T, cap]
        mask = (pos_k[:, None, :] >= 0) & (dist >= 0) & (dist < self.context)
        return pos_q % cap, mask[:, None]

    def step(self, x: Tensor, state: TransformerState) -> Tensor:
        # x: [B, T, D]
        T = x.shape[1]
        write_idx, mask = self._ring_mask(state.end, T)
        cos, sin = rope_angles(state.end, T, self.head_dim, self.max_period)
        for i, layer in enumerate(self.layers):
            x = layer.step(x, state.kv[i], write_idx, mask, cos, sin)
        state.end.add_(T)
        return x


class ProjectedTransformer(nn.Module):
    """The transformer in conv layout [B, C, T]; d_model equals the latent size, so no projections."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        assert cfg.transformer_d_model == cfg.dimension, "input/output projections are not implemented"
        self.transformer = StreamingTransformer(cfg)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> TransformerState:
        return self.transformer.init_state(batch_size, device, dtype)

    def step(self, x: Tensor, state: TransformerState) -> Tensor:
        return self.transformer.step(x.transpose(1, 2), state).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# Resampling 25 Hz <-> 12.5 Hz
# --------------------------------------------------------------------------------------------


class ConvDownsample1d(nn.Module):
    """Learnt causal conv, kernel 2*stride, no bias, replicate left padding on a row's first call."""

    def __init__(self, stride: int, dimension: int):
        super().__init__()
        self.conv = StreamingConv1d(dimension, dimension, 2 * stride, stride=stride, bias=False,
                                    replicate=True)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvState:
        return self.conv.init_state(batch_size, device, dtype)

    def step(self, x: Tensor, state: ConvState) -> Tensor:
        return self.conv.step(x, state)


class ConvTrUpsample1d(nn.Module):
    """Learnt transposed conv, kernel 2*stride, no bias, channel-wise (groups = dimension)."""

    def __init__(self, stride: int, dimension: int):
        super().__init__()
        self.convtr = StreamingConvTranspose1d(dimension, dimension, 2 * stride, stride=stride,
                                               groups=dimension, bias=False)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvTrState:
        return self.convtr.init_state(batch_size, device, dtype)

    def step(self, x: Tensor, state: ConvTrState) -> Tensor:
        return self.convtr.step(x, state)


# --------------------------------------------------------------------------------------------
# Split residual vector quantizer
# --------------------------------------------------------------------------------------------


class EuclideanCodebook(nn.Module):
    """Codebook buffers as stored; the code vectors are embedding_sum / clamp(cluster_usage)."""

    def __init__(self, dim: int, codebook_size: int, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("_initialized", torch.zeros(1))
        self.register_buffer("cluster_usage", torch.ones(codebook_size))
        self.register_buffer("embedding_sum", torch.zeros(codebook_size, dim))
        self._cache: tuple[tuple, Tensor] | None = None

    def _buffer_key(self) -> tuple | None:
        # Identity and version counter of both buffers: the cache follows loads, moves and
        # in-place edits. Inference tensors have no version counter; they are not cached.
        try:
            return (self.embedding_sum.data_ptr(), self.embedding_sum._version,
                    self.cluster_usage.data_ptr(), self.cluster_usage._version,
                    self.embedding_sum.device, self.embedding_sum.dtype)
        except RuntimeError:
            return None

    @property
    def embedding(self) -> Tensor:
        """Code vectors [codebook_size, dim]."""
        key = self._buffer_key()
        if key is not None and self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        emb = self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]
        if key is not None:
            self._cache = (key, emb)
        return emb


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, codebook_size)

    def encode(self, x: Tensor) -> Tensor:
        # x: [N, dim] -> codes [N]. torch.cdist as the reference (its matmul path for 2048
        # codes), so near-ties resolve the same way.
        return torch.cdist(x[None], self._codebook.embedding[None], p=2)[0].argmin(dim=-1)

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [N] -> [N, dim]
        return F.embedding(codes, self._codebook.embedding)


class ResidualVectorQuantization(nn.Module):
    def __init__(self, num_quantizers: int, dim: int, codebook_size: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, codebook_size) for _ in range(num_quantizers))


class ResidualVectorQuantizer(nn.Module):
    """1x1 conv input/output projections around a residual VQ."""

    def __init__(self, n_q: int, input_dim: int, dim: int, codebook_size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(input_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, input_dim, 1, bias=False)
        self.vq = ResidualVectorQuantization(n_q, dim, codebook_size)

    def encode(self, z: Tensor, n_q: int) -> Tensor:
        # z: [B, C, 1] -> codes [B, n_q]
        residual = self.input_proj(z)[..., 0]  # [B, dim]
        codes = []
        for layer in self.vq.layers[:n_q]:
            c = layer.encode(residual)
            residual = residual - layer.decode(c)
            codes.append(c)
        return torch.stack(codes, dim=1)

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, n] -> [B, C, 1]; levels summed in order, as the reference does
        q = self.vq.layers[0].decode(codes[:, 0])
        for i in range(1, codes.shape[1]):
            q = q + self.vq.layers[i].decode(codes[:, i])
        return self.output_proj(q[..., None])


class SplitResidualVectorQuantizer(nn.Module):
    """One semantic codebook (rvq_first) plus acoustic levels (rvq_rest), both on the same latent."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        dims = (cfg.dimension, cfg.quantizer_dimension, cfg.quantizer_bins)
        self.rvq_first = ResidualVectorQuantizer(1, *dims)
        self.rvq_rest = ResidualVectorQuantizer(cfg.quantizer_n_q - 1, *dims)

    def encode(self, z: Tensor, num_codebooks: int) -> Tensor:
        # z: [B, C, 1] -> [B, num_codebooks]
        first = self.rvq_first.encode(z, 1)
        rest = self.rvq_rest.encode(z, num_codebooks - 1)
        return torch.cat([first, rest], dim=1)

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, K] -> [B, C, 1]
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --------------------------------------------------------------------------------------------
# Mimi
# --------------------------------------------------------------------------------------------


class Mimi(nn.Module):
    """Streaming Mimi codec with explicit, per-row resettable state (spec §D)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        encoder_rate = cfg.sample_rate / cfg.hop_length  # 25 Hz
        stride = encoder_rate / cfg.frame_rate
        assert stride == int(stride), (encoder_rate, cfg.frame_rate)
        self.resample_stride = int(stride)
        # Registration order gives the checkpoint's key order.
        self.encoder = SEANetEncoder(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.encoder_transformer = ProjectedTransformer(cfg)
        self.decoder_transformer = ProjectedTransformer(cfg)
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.downsample = ConvDownsample1d(self.resample_stride, cfg.dimension)
        self.upsample = ConvTrUpsample1d(self.resample_stride, cfg.dimension)
        logger.debug("Mimi: latent %d, %d+%d transformer layers, frame %d samples, %d of %d codebooks",
                     cfg.dimension, cfg.transformer_num_layers, cfg.transformer_num_layers,
                     self.frame_size, self.num_codebooks, cfg.quantizer_n_q)

    @property
    def frame_size(self) -> int:
        return self.cfg.frame_size

    @property
    def num_codebooks(self) -> int:
        return self.cfg.num_codebooks

    @property
    def cardinality(self) -> int:
        return self.cfg.quantizer_bins

    def _param_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        w = self.encoder.model[0].conv.conv.weight
        return w.device, w.dtype

    # ---- state ----

    def init_encoder_state(self, batch_size: int, device: torch.device | None = None,
                           dtype: torch.dtype | None = None) -> EncoderState:
        d, t = self._param_device_dtype()
        device, dtype = device or d, dtype or t
        return EncoderState(
            seanet=self.encoder.init_state(batch_size, device, dtype),
            transformer=self.encoder_transformer.init_state(batch_size, device, dtype),
            downsample=self.downsample.init_state(batch_size, device, dtype),
        )

    def init_decoder_state(self, batch_size: int, device: torch.device | None = None,
                           dtype: torch.dtype | None = None) -> DecoderState:
        d, t = self._param_device_dtype()
        device, dtype = device or d, dtype or t
        return DecoderState(
            upsample=self.upsample.init_state(batch_size, device, dtype),
            transformer=self.decoder_transformer.init_state(batch_size, device, dtype),
            seanet=self.decoder.init_state(batch_size, device, dtype),
        )

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> MimiState:
        """Fresh streams for `batch_size` rows (preallocated; stepping only updates it in place)."""
        return MimiState(self.init_encoder_state(batch_size, device, dtype),
                         self.init_decoder_state(batch_size, device, dtype))

    def reset_encoder_rows(self, state: MimiState | EncoderState, rows: Rows) -> None:
        enc = state.encoder if isinstance(state, MimiState) else state
        carry = enc.downsample.carry
        enc.reset_rows(_row_mask(rows, carry.shape[0], carry.device))

    def reset_decoder_rows(self, state: MimiState | DecoderState, rows: Rows) -> None:
        dec = state.decoder if isinstance(state, MimiState) else state
        tail = dec.upsample.tail
        dec.reset_rows(_row_mask(rows, tail.shape[0], tail.device))

    def reset_rows(self, state: MimiState, rows: Rows) -> None:
        """Makes `rows` (bool mask [B] or row indices) fresh streams, encoder and decoder side."""
        self.reset_encoder_rows(state, rows)
        self.reset_decoder_rows(state, rows)

    # ---- streaming steps ----

    @torch.no_grad()
    def encode_step(self, pcm: Tensor, state: MimiState | EncoderState) -> Tensor:
        """pcm [B, frame_size] or [B, 1, frame_size] -> codes int64 [B, num_codebooks]."""
        enc = state.encoder if isinstance(state, MimiState) else state
        B = pcm.shape[0]
        x = pcm.reshape(B, 1, -1)
        assert x.shape[-1] == self.frame_size, (pcm.shape, self.frame_size)
        device, dtype = self._param_device_dtype()
        x = x.to(device=device, dtype=dtype)
        z = self.encoder.step(x, enc.seanet)  # [B, D, 2]
        z = self.encoder_transformer.step(z, enc.transformer)  # [B, D, 2]
        z = self.downsample.step(z, enc.downsample)  # [B, D, 1]
        return self.quantizer.encode(z, self.num_codebooks)  # [B, K]

    @torch.no_grad()
    def decode_step(self, codes: Tensor, state: MimiState | DecoderState) -> Tensor:
        """codes [B, num_codebooks] (or [B, K, 1]), valid ids < cardinality -> pcm [B, frame_size]."""
        dec = state.decoder if isinstance(state, MimiState) else state
        codes = codes.reshape(codes.shape[0], -1).to(device=self._param_device_dtype()[0],
                                                     dtype=torch.long)
        assert codes.shape[1] == self.num_codebooks, (codes.shape, self.num_codebooks)
        z = self.quantizer.decode(codes)  # [B, D, 1]
        z = self.upsample.step(z, dec.upsample)  # [B, D, 2]
        z = self.decoder_transformer.step(z, dec.transformer)  # [B, D, 2]
        y = self.decoder.step(z, dec.seanet)  # [B, 1, frame_size]
        return y[:, 0]


__all__ = [
    "ConvState", "ConvTrState", "DecoderState", "EncoderState", "Mimi", "MimiState",
    "TransformerState",
]
