"""Per-row sampling for a batch: temperature, top-k, greedy and a seed per conversation.

The reference sampler divides the logits by the temperature, takes a softmax, keeps the
top-k and picks argmax(p / q) with q ~ Exp(1) (docs/engine.md § Sampling). Its random draws come from one
global generator, so a caller's tokens would depend on who else is in the batch. Here each
draw is a pure function of (row seed, row tick, stream, index): a counter-based hash that is
batched, device independent and reproducible per call, with no per-row generator loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors, as `model.hashinit.fmix32` on numpy."""
    # int64 products wrap on overflow, but the low 32 bits stay exact, which is all we keep.
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def exponential_noise(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Exp(1) draws [B, n] from per-row seed [B] and counter [B] (int64)."""
    idx = torch.arange(n, device=seed.device, dtype=torch.long).view(1, n)
    c = fmix32(fmix32(seed.view(-1, 1) ^ 0x5BD1E995) ^ (counter.view(-1, 1) * 0x27D4EB2F + stream * 0x165667B1))
    h = fmix32(((idx * 0x9E3779B1) & _M32) ^ c)
    u = (h.double() + 0.5) / 4294967296.0  # in (0, 1): never log(0)
    return (-torch.log(u)).float()


@dataclass
class SamplingState:
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


def sample(logits: torch.Tensor, state: SamplingState, counter: torch.Tensor, stream: int,
           max_top_k: int) -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B]. Greedy rows take the first maximal index."""
    greedy = logits.argmax(dim=-1)
    k = min(max_top_k, logits.shape[-1])
    temp = state.temperature.clamp(min=1e-5).view(-1, 1)
    probs = torch.softmax(logits / temp, dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)  # sorted, descending
    keep = torch.arange(k, device=logits.device).view(1, k) < state.top_k.clamp(1, k).view(-1, 1)
    q = exponential_noise(state.seed, counter, stream, k)
    choice = torch.where(keep, top_p / q, torch.zeros_like(top_p)).argmax(dim=-1, keepdim=True)
    sampled = top_i.gather(-1, choice)[:, 0]
    return torch.where(state.greedy, greedy, sampled)
