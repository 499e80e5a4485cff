"""Model configurations: the full PersonaPlex-7B and the tiny hash-v1 test models. Field names
follow NVIDIA's `LMModel` / `MimiModel` keyword arguments where one exists."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..frame import AUDIO_CARD, SAMPLE_RATE, TEXT_CARD

# Delays of the rows of one frame: text, agent cb0..7, user cb0..7 (docs/engine.md § Frame layout).
PERSONAPLEX_DELAYS = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)

WEIGHTS = ("dense", "int8")  # how the LM's weights are held (`--weights`; model/int8.py)
# An int8 layer multiplies by the int8 values before their scale: sums about 1000x the real ones,
# past float16's 65504 (bfloat16 and float32 have the range).
INT8_FLOAT16 = ("--weights int8 needs --dtype bfloat16 or float32: float16 overflows before the int8 scales "
                "are applied")
# The LM weights that `--weights int8` holds as int8: every matrix of the temporal transformer's
# and the depformer's layers, and the depformer's input projections (model/int8.py).
INT8_KEYS = re.compile(r"(transformer|depformer)\.layers\.\d+\.(self_attn\.in_proj_weight|self_attn\.out_proj\.weight"
                       r"|gating(\.\d+)?\.linear_(in|out)\.weight)|depformer_in\.\d+\.weight")


def quantized_key(key: str) -> bool:
    """Whether `--weights int8` holds the LM checkpoint key's tensor as int8."""
    return INT8_KEYS.fullmatch(key) is not None


def _feedforward_hidden(dim: int, dim_feedforward: int) -> int:
    # The reference's gated feed-forward: 21/8 of the width when the FFN is exactly 4x, else 2/3 of it.
    if dim_feedforward == 4 * dim:
        return (21 * dim) // 8
    return (2 * dim_feedforward) // 3


@dataclass(frozen=True)
class LMConfig:
    """The LM's shape; the defaults are PersonaPlex-7B's."""

    # Temporal transformer
    dim: int = 4096
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125  # dim_feedforward / dim
    context: int = 3000  # frames of attention (240 s), and the KV ring's capacity
    max_period: float = 10000.0  # RoPE
    # Streams: text vocabulary, audio codes, audio streams in / generated per frame
    text_card: int = TEXT_CARD
    card: int = AUDIO_CARD
    n_q: int = 16
    dep_q: int = 16
    # Depformer
    depformer_dim: int = 1024
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    depformer_dim_feedforward: int = int(4.125 * 1024)
    delays: tuple[int, ...] = PERSONAPLEX_DELAYS  # per row of a frame
    norm_eps: float = 1e-8  # of every RMSNorm

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden(self) -> int:
        return _feedforward_hidden(self.dim, int(self.hidden_scale * self.dim))

    @property
    def depformer_hidden(self) -> int:
        return _feedforward_hidden(self.depformer_dim, self.depformer_dim_feedforward)

    @classmethod
    def tiny(cls) -> LMConfig:
        """The golden fixtures' tiny LM (tests/golden/lm-tiny.config.json)."""
        return cls(dim=64, num_heads=4, num_layers=2, depformer_dim=32, depformer_num_heads=4,
                   depformer_num_layers=2, depformer_dim_feedforward=int(4.125 * 32))


@dataclass(frozen=True)
class MimiConfig:
    """Mimi's shape; the defaults are PersonaPlex's codec."""

    sample_rate: int = SAMPLE_RATE  # Hz
    frame_rate: float = 12.5  # frames per second: 80 ms, 1920 samples
    channels: int = 1
    # SEANet
    n_filters: int = 64
    dimension: int = 512  # the latent's channels
    ratios: tuple[int, ...] = (8, 6, 5, 4)  # decoder upsampling; the encoder's strides reversed
    kernel_size: int = 7
    residual_kernel_size: int = 3
    last_kernel_size: int = 3
    compress: int = 2
    # Transformers (encoder and decoder side)
    transformer_d_model: int = 512
    transformer_num_heads: int = 8
    transformer_num_layers: int = 8
    transformer_dim_feedforward: int = 4 * 512  # four times d_model
    transformer_context: int = 250
    transformer_max_period: float = 10000.0
    # Split RVQ
    quantizer_dimension: int = 256
    quantizer_n_q: int = 32
    quantizer_bins: int = AUDIO_CARD
    num_codebooks: int = 8

    @property
    def frame_size(self) -> int:
        """PCM samples per 80 ms frame (1920)."""
        return int(self.sample_rate / self.frame_rate)

    @classmethod
    def tiny(cls) -> MimiConfig:
        """The golden fixtures' tiny Mimi (tests/golden/mimi-tiny.config.json)."""
        return cls(n_filters=8, dimension=32, transformer_d_model=32, transformer_num_heads=4,
                   transformer_num_layers=2, transformer_dim_feedforward=128, transformer_context=64,
                   quantizer_dimension=16, quantizer_n_q=8)


@dataclass(frozen=True)
class ModelFiles:
    """File names of a PersonaPlex model repository (docs/model.md)."""

    lm: str = "model.safetensors"
    mimi: str = "tokenizer-e351c8d8-checkpoint125.safetensors"
    tokenizer: str = "tokenizer_spm_32k_3.model"
    voices: str = "voices.tgz"

