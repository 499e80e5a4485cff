"""Mimi's SEANet encoder and decoder, made of causal convolutions fed one chunk at a time, each
with its own per-row state (docs/model.md § Mimi)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import MimiConfig
from .ring import RowStates


@dataclass
class ConvState(RowStates):
    """Left context of one causal conv: the last `k - stride` input samples of each row."""

    carry: Tensor  # [B, C_in, k - stride], zeros for a fresh row
    fresh: Tensor | None = None  # [B] bool, only for replicate padding: row has not been fed yet

    def reset_rows(self, mask: Tensor) -> None:
        self.carry.masked_fill_(mask[:, None, None], 0.0)
        if self.fresh is not None:
            self.fresh.masked_fill_(mask, True)


@dataclass
class ConvTrState(RowStates):
    """Overlap tail of one transposed conv, stored without the bias (it is added once per call)."""

    tail: Tensor  # [B, C_out, k - stride]


class StreamingConv1d(nn.Module):
    """Causal conv1d fed chunk by chunk: y = conv(cat(carry, x)), carry = last k - stride inputs.
    A fresh row's carry is zeros (the reference's constant left padding), or with `replicate=True`
    copies of its first input frame. Chunk lengths must be multiples of the stride."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 bias: bool = True, replicate: bool = False):
        super().__init__()
        # The checkpoint was trained with weight norm, folded before release; the wrapper's level
        # survives in the key names (`….conv.conv.weight`).
        conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, bias=bias)
        self.conv = nn.ModuleDict({"conv": conv})
        self.stride = stride
        self.context = kernel_size - stride  # samples carried between calls
        self.replicate = replicate

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvState:
        carry = torch.zeros(batch_size, self.conv.conv.in_channels, self.context, device=device, dtype=dtype)
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
    """Causal transposed conv fed chunk by chunk. The last P = k - stride outputs of a call still
    receive contributions from the next input, so they are held back (without the bias, which the
    next call's output already carries): y[:, :, :P] += tail; tail = y[:, :, -P:] - bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 groups: int = 1, bias: bool = True):
        super().__init__()
        # The weight-norm wrapper's level, as in `StreamingConv1d` (`….convtr.convtr.weight`).
        convtr = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        self.convtr = nn.ModuleDict({"convtr": convtr})
        self.stride = stride
        self.overlap = kernel_size - stride
        self.matmul_ok = groups == 1 and kernel_size == 2 * stride

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> ConvTrState:
        return ConvTrState(torch.zeros(batch_size, self.convtr.convtr.out_channels, self.overlap,
                                       device=device, dtype=dtype))

    def step(self, x: Tensor, state: ConvTrState) -> Tensor:
        # x: [B, C_in, T] -> [B, C_out, T * stride]
        if self.matmul_ok and x.shape[-1] <= MATMUL_MAX_STEPS:
            return self._step_matmul(x, state)
        convtr = self.convtr.convtr
        y = convtr(x)  # [B, C_out, T * stride + P]
        p = self.overlap
        y[..., :p] += state.tail
        tail = y[..., y.shape[-1] - p:]
        if convtr.bias is not None:
            tail = tail - convtr.bias[:, None]
        state.tail.copy_(tail)
        return y[..., : y.shape[-1] - p]

    def _step_matmul(self, x: Tensor, state: ConvTrState) -> Tensor:
        """The same transposed conv as one matmul, for kernel = 2 * stride and few input steps: each
        input step's 2 * stride outputs land half on its own block, half on the next. On the CPU,
        PyTorch runs a short transposed conv through a slow generic kernel, several times this."""
        convtr = self.convtr.convtr
        B, c_in, T = x.shape
        s, c_out = self.stride, convtr.out_channels
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


class ResidualUnit(nn.Module):
    """x + conv1x1(elu(conv_k3(elu(x)))), the identity skip ("true skip")."""

    def __init__(self, dim: int, kernel_size: int, compress: int):
        super().__init__()
        hidden = dim // compress
        self.block = nn.Sequential(
            nn.ELU(alpha=1.0),
            StreamingConv1d(dim, hidden, kernel_size),
            nn.ELU(alpha=1.0),
            StreamingConv1d(hidden, dim, 1),
        )

    def step(self, x: Tensor, states: Iterator) -> Tensor:
        return x + _run_layers(self.block, x, states)


class SEANet(nn.Module):
    """`model`, a Sequential of ELUs, streaming convs and residual units, stepped with one state per conv."""

    model: nn.Sequential

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> list[ConvState | ConvTrState]:
        # modules() walks registration order, which is the forward order in these Sequentials.
        return [m.init_state(batch_size, device, dtype) for m in self.model.modules() if isinstance(m, _StreamingConv)]

    def step(self, x: Tensor, states: list[ConvState | ConvTrState]) -> Tensor:
        return _run_layers(self.model, x, iter(states))


class SEANetEncoder(SEANet):
    """[B, 1, T] -> [B, dimension, T / hop]; strides are the ratios reversed (4, 5, 6, 8)."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        nf = cfg.n_filters
        layers: list[nn.Module] = [StreamingConv1d(cfg.channels, nf, cfg.kernel_size)]
        mult = 1
        for ratio in reversed(cfg.ratios):
            # Mimi has one residual unit per stage (n_residual_layers = 1, so dilation base**0 = 1).
            layers += [
                ResidualUnit(mult * nf, cfg.residual_kernel_size, cfg.compress),
                nn.ELU(alpha=1.0),
                StreamingConv1d(mult * nf, 2 * mult * nf, 2 * ratio, stride=ratio),
            ]
            mult *= 2
        layers += [nn.ELU(alpha=1.0), StreamingConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)


class SEANetDecoder(SEANet):
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
                ResidualUnit(mult * nf // 2, cfg.residual_kernel_size, cfg.compress),
            ]
            mult //= 2
        layers += [nn.ELU(alpha=1.0), StreamingConv1d(nf, cfg.channels, cfg.last_kernel_size)]
        self.model = nn.Sequential(*layers)
