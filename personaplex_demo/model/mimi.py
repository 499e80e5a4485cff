"""Native streaming Mimi codec: 24 kHz PCM <-> 12.5 Hz frames of 8 RVQ codes, per frame as drawn in
docs/model.md § Mimi. Streaming state has a leading batch dimension, so any rows can be reset; module
names reproduce the official checkpoint's 318 keys, and the numerics the reference's operation order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MimiConfig
from .quantizer import SplitResidualVectorQuantizer
from .ring import RingKV, RowStates
from .seanet import ConvState, ConvTrState, SEANetDecoder, SEANetEncoder, StreamingConv1d, StreamingConvTranspose1d
from .transformer import Attention, LayerScale, Transformer, TransformerLayer

logger = logging.getLogger(__name__)


@dataclass
class EncoderState(RowStates):
    seanet: list[ConvState]  # one per conv of the SEANet encoder, in forward order
    transformer: RingKV
    downsample: ConvState  # replicate-padded on each row's first frame


@dataclass
class DecoderState(RowStates):
    upsample: ConvTrState
    transformer: RingKV
    seanet: list[ConvState | ConvTrState]  # one per (transposed) conv of the decoder, in order


@dataclass
class MimiState(RowStates):
    """Encoder and decoder streaming state; the two are fully independent."""

    encoder: EncoderState
    decoder: DecoderState


class MimiLayer(TransformerLayer):
    """LayerNorm, GELU feed-forward (`linear1`, `linear2`), each branch scaled by a LayerScale."""

    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int):
        super().__init__()
        self.self_attn = Attention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        self.layer_scale_1 = LayerScale(d_model)
        self.layer_scale_2 = LayerScale(d_model)

    def feed_forward(self, x: Tensor, step: int | None) -> Tensor:
        return self.linear2(F.gelu(self.linear1(x)))


class ProjectedTransformer(nn.Module):
    """The transformer in conv layout [B, C, T]; d_model equals the latent size, so no projections."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        assert cfg.transformer_d_model == cfg.dimension, "input/output projections are not implemented"
        d, heads = cfg.transformer_d_model, cfg.transformer_num_heads
        self.context = cfg.transformer_context  # attention window, and the ring's capacity
        self.transformer = Transformer([MimiLayer(d, heads, cfg.transformer_dim_feedforward)
                                        for _ in range(cfg.transformer_num_layers)],
                                       d // heads, cfg.transformer_max_period)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> RingKV:
        attn = self.transformer.layers[0].self_attn
        return RingKV.empty(len(self.transformer.layers), batch_size, attn.num_heads, self.context,
                            attn.dim // attn.num_heads, device, dtype)

    def step(self, x: Tensor, kv: RingKV) -> Tensor:
        x = x.transpose(1, 2)  # [B, T, C]
        attend = kv.advance(x.shape[1], self.context)
        return self.transformer(x, attend, kv).transpose(1, 2)


class Mimi(nn.Module):
    """Streaming Mimi codec with explicit, per-row resettable state."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        encoder_rate = cfg.sample_rate / math.prod(cfg.ratios)  # 25 Hz: the SEANet's strides
        stride = encoder_rate / cfg.frame_rate
        assert stride == int(stride), (encoder_rate, cfg.frame_rate)
        s, d = int(stride), cfg.dimension
        # Registration order gives the checkpoint's key order.
        self.encoder = SEANetEncoder(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.encoder_transformer = ProjectedTransformer(cfg)
        self.decoder_transformer = ProjectedTransformer(cfg)
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        # Learnt resampling between 25 and 12.5 Hz, kernel 2 * stride, no bias: down with replicate padding
        # on a row's first frame, up channel-wise. The extra key level is the reference's wrapper module.
        self.downsample = nn.ModuleDict({"conv": StreamingConv1d(d, d, 2 * s, s, bias=False, replicate=True)})
        self.upsample = nn.ModuleDict(
            {"convtr": StreamingConvTranspose1d(d, d, 2 * s, s, groups=d, bias=False)})
        logger.debug("Mimi: latent %d, %d+%d transformer layers, frame %d samples, %d of %d codebooks",
                     cfg.dimension, cfg.transformer_num_layers, cfg.transformer_num_layers,
                     cfg.frame_size, cfg.num_codebooks, cfg.quantizer_n_q)

    def _param_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        w = self.encoder.model[0].conv.conv.weight
        return w.device, w.dtype

    # ---- state ----

    def init_state(self, batch_size: int, device: torch.device | None = None) -> MimiState:
        """Fresh streams for `batch_size` rows (preallocated; stepping only updates it in place)."""
        d, t = self._param_device_dtype()
        a = (batch_size, device or d, t)
        return MimiState(
            EncoderState(self.encoder.init_state(*a), self.encoder_transformer.init_state(*a),
                         self.downsample.conv.init_state(*a)),
            DecoderState(self.upsample.convtr.init_state(*a), self.decoder_transformer.init_state(*a),
                         self.decoder.init_state(*a)))

    def reset_rows(self, state: MimiState, rows: Sequence[int]) -> None:
        """Makes the rows of indices `rows` fresh streams, encoder and decoder side."""
        end = state.encoder.transformer.end
        mask = torch.zeros_like(end, dtype=torch.bool)
        state.reset_rows(mask.index_fill_(0, torch.tensor(rows, dtype=torch.long, device=end.device), True))

    # ---- streaming steps ----

    @torch.no_grad()
    def encode_step(self, pcm: Tensor, state: MimiState) -> Tensor:
        """pcm [B, frame_size] or [B, 1, frame_size] -> codes int64 [B, num_codebooks]."""
        enc = state.encoder
        x = pcm.reshape(pcm.shape[0], 1, -1)
        assert x.shape[-1] == self.cfg.frame_size, (pcm.shape, self.cfg.frame_size)
        device, dtype = self._param_device_dtype()
        z = self.encoder.step(x.to(device=device, dtype=dtype), enc.seanet)  # [B, D, 2]
        z = self.encoder_transformer.step(z, enc.transformer)  # [B, D, 2]
        z = self.downsample.conv.step(z, enc.downsample)  # [B, D, 1]
        return self.quantizer.encode(z, self.cfg.num_codebooks)  # [B, K]

    @torch.no_grad()
    def decode_step(self, codes: Tensor, state: MimiState) -> Tensor:
        """codes [B, num_codebooks] (or [B, K, 1]), valid ids < quantizer_bins -> pcm [B, frame_size]."""
        dec = state.decoder
        codes = codes.reshape(codes.shape[0], -1).to(device=self._param_device_dtype()[0], dtype=torch.long)
        assert codes.shape[1] == self.cfg.num_codebooks, (codes.shape, self.cfg.num_codebooks)
        z = self.quantizer.decode(codes)  # [B, D, 1]
        z = self.upsample.convtr.step(z, dec.upsample)  # [B, D, 2]
        z = self.decoder_transformer.step(z, dec.transformer)  # [B, D, 2]
        y = self.decoder.step(z, dec.seanet)  # [B, 1, frame_size]
        return y[:, 0]

