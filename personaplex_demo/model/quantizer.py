"""Mimi's split residual vector quantizer: one semantic codebook and the acoustic levels, both
on the same latent (docs/model.md § Mimi)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MimiConfig


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


class ResidualVectorQuantizer(nn.Module):
    """1x1 conv input/output projections around a residual VQ."""

    def __init__(self, n_q: int, input_dim: int, dim: int, codebook_size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(input_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, input_dim, 1, bias=False)
        # The levels, under the reference's `vq.layers.N` keys.
        levels = nn.ModuleList(VectorQuantization(dim, codebook_size) for _ in range(n_q))
        self.vq = nn.ModuleDict({"layers": levels})

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
