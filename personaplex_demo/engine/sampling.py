"""Per-row sampling for a batch: temperature, top-k, greedy and a seed per conversation
(docs/engine.md § Sampling). Each draw is a pure function of (row seed, row tick, stream, token id),
so a caller's tokens do not depend on who else is in the batch (docs/design-notes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.ring import RowStates

_M32 = 0xFFFFFFFF
# How many top-k candidates a tick ranks: the largest top-k in use, rounded up to one of these (or
# the vocabulary), so that the CUDA graphs of the tick are a few per stream, not one per setting.
TOP_K_BUCKETS = (32, 256, 2048)


def top_k_bucket(k: int, vocab: int) -> int:
    """How many candidates a batch whose largest top-k is `k` ranks."""
    return min(next((b for b in TOP_K_BUCKETS if b >= k), vocab), vocab)


def top_k_buckets(vocab: int) -> list[int]:
    """Every value `top_k_bucket` takes for a vocabulary of `vocab` tokens."""
    return [b for b in TOP_K_BUCKETS if b < vocab] + [vocab]


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors, as `model.hashinit.fmix32` on numpy."""
    # int64 products wrap on overflow, but the low 32 bits stay exact, which is all we keep.
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def stream_keys(seed: torch.Tensor, counter: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Hash keys [B, n] of every row's draws this tick: seed [B, n] (each stream's row seed),
    counter [B] (the row's tick), streams [n] (0: text, 1 + s: audio step s)."""
    return fmix32(fmix32(seed ^ 0x5BD1E995) ^ (counter.view(-1, 1) * 0x27D4EB2F + streams * 0x165667B1))


def exponential_noise(key: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws [B, K] for token ids `tokens` [B, K] under the row keys `key` [B, 1]."""
    # fmix32 is a bijection of 32-bit words, so distinct tokens never share a draw.
    h = fmix32(tokens ^ key)
    u = (h.double() + 0.5) / 4294967296.0  # in (0, 1): never log(0)
    return (-torch.log(u)).float()


@dataclass
class SamplingState(RowStates):
    """Per-row knobs as tensors [B], so one call samples the whole batch."""

    temperature: torch.Tensor  # float
    top_k: torch.Tensor  # long
    greedy: torch.Tensor  # bool
    seed: torch.Tensor  # long

    @classmethod
    def empty(cls, batch: int, device: torch.device | str) -> SamplingState:
        """Every row greedy (top-k 1, temperature 1, seed 0) until `set_row`."""
        return cls(torch.ones(batch, device=device), torch.ones(batch, dtype=torch.long, device=device),
                   torch.ones(batch, dtype=torch.bool, device=device), torch.zeros(batch, dtype=torch.long, device=device))

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Back to `empty`'s values for the rows of the bool mask `rows` [B]."""
        self.temperature.masked_fill_(rows, 1.0)
        self.top_k.masked_fill_(rows, 1)
        self.greedy.masked_fill_(rows, True)
        self.seed.masked_fill_(rows, 0)

    def set_row(self, row: int, temperature: float, top_k: int, greedy: bool, seed: int) -> None:
        self.temperature[row] = temperature
        self.top_k[row] = top_k
        self.greedy[row] = greedy or temperature <= 0.0
        self.seed[row] = seed & _M32


@dataclass
class TopK:
    """One tick's per-row knobs of one kind of stream, prepared once for all its draws."""

    k: int  # candidates ranked: the bucket of the largest top-k in use
    temperature: torch.Tensor  # [B, 1], clamped away from 0
    last: torch.Tensor  # [B, 1] long: the rank of the row's k-th candidate
    greedy: torch.Tensor  # [B] bool

    @classmethod
    def prepare(cls, state: SamplingState, k: int) -> TopK:
        return cls(k, state.temperature.clamp(min=1e-5).view(-1, 1), (state.top_k.clamp(1, k) - 1).view(-1, 1),
                   state.greedy)


def sample(logits: torch.Tensor, knobs: TopK, key: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B], with the row keys `key` [B, 1] of this draw (see
    `stream_keys`). Greedy rows take the first maximal index. The top-k cut is by value, so that
    ties at the k-th place survive together whatever order `topk` lists them in."""
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / knobs.temperature, dim=-1)
    top_p, top_i = probs.topk(knobs.k, dim=-1)  # sorted, descending
    drop = top_p < top_p.gather(-1, knobs.last)
    ratio = (top_p / exponential_noise(key, top_i)).masked_fill_(drop, 0.0)
    sampled = top_i.gather(-1, ratio.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(knobs.greedy, greedy, sampled)
