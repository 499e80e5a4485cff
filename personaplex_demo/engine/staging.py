"""The token staging ring: where each row's 17 token streams wait out their delays (docs/engine.md §
Staging ring and delays). Row k of a frame provided at a row's offset o goes to column (o + delay[k]) % CT.
"""

from __future__ import annotations

import copy

import torch

from .tokens import AUDIO_INITIAL, TEXT_INITIAL


class StagingRing:
    """The token staging ring of every row: cache/provided [B, 17, CT] and `local` [B]."""

    def __init__(self, batch: int, delays: tuple[int, ...], device: torch.device | str):
        self.K = len(delays)
        self.CT = max(delays) + 3
        self.max_delay = max(delays)
        self.delays = torch.tensor(delays, dtype=torch.long, device=device)
        self.initial = torch.tensor([TEXT_INITIAL] + [AUDIO_INITIAL] * (self.K - 1), dtype=torch.long, device=device)
        self.cache = self.initial.view(1, -1, 1).repeat(batch, 1, self.CT)
        self.provided = torch.zeros(batch, self.K, self.CT, dtype=torch.bool, device=device)
        self.local = torch.zeros(batch, dtype=torch.long, device=device)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.cache[rows] = self.initial.view(-1, 1)
        self.provided[rows] = False
        self.local[rows] = 0

    def head(self, rows: int) -> StagingRing:
        """The first `rows` rows, sharing this ring's storage."""
        view = copy.copy(self)
        view.cache, view.provided, view.local = self.cache[:rows], self.provided[:rows], self.local[:rows]
        return view

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.cache, self.provided, self.local):
            t[dst] = t[src]

    def _col(self, offset: torch.Tensor) -> torch.Tensor:
        return (offset % self.CT).view(-1, 1, 1).expand(-1, self.K, 1)

    def _provide(self, cols: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Write `values` [B, 17] (or [1, 17]) into columns `cols` [B, 17, 1] where `mask`
        [B, 17], and mark them provided."""
        old = self.cache.gather(2, cols)[..., 0]
        self.cache.scatter_(2, cols, torch.where(mask, values, old)[..., None])
        self.provided.scatter_(2, cols, (self.provided.gather(2, cols)[..., 0] | mask)[..., None])

    def stage(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Provide tokens [B, 17] where mask [B, 17]: row k goes to column local + delay[k]."""
        self._provide(((self.local.view(-1, 1) + self.delays.view(1, -1)) % self.CT)[..., None], values, mask)

    def warm_up(self, rows: torch.Tensor) -> None:
        """At the start of a stream a delayed row has no value yet: use the initial token."""
        gate = (self.local.view(-1, 1) <= self.delays.view(1, -1)) & rows.view(-1, 1)
        self._provide(self._col(self.local), self.initial.view(1, -1), gate)

    def dead_step(self, rows: torch.Tensor) -> None:
        """The reference's model-less step at offset 0 (docs/engine.md § The tick)."""
        self.cache[:, :, 0] = torch.where(rows.view(-1, 1), self.initial.view(1, -1), self.cache[:, :, 0])
        self.local += rows.long()

    def columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(model input [B, 17], target [B, 17], target provided [B, 17])."""
        mip = self._col(self.local - 1)
        tp = self._col(self.local)
        return self.cache.gather(2, mip)[..., 0], self.cache.gather(2, tp)[..., 0], self.provided.gather(2, tp)[..., 0]

    def commit(self, chosen: torch.Tensor, rows: torch.Tensor) -> None:
        """Write chosen tokens [B, 17] into the target column where not provided."""
        mip = self._col(self.local - 1)
        tp = self._col(self.local)
        prov_mip = self.provided.gather(2, mip)[..., 0]
        self.provided.scatter_(2, mip, (prov_mip & ~rows.view(-1, 1))[..., None])
        prov = self.provided.gather(2, tp)[..., 0]
        old = self.cache.gather(2, tp)[..., 0]
        write = rows.view(-1, 1) & ~prov
        self.cache.scatter_(2, tp, torch.where(write, chosen, old)[..., None])

    def emitted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(frame [B, 17], emitted [B]): text and agent cb0 from column o-1, the rest from o."""
        cols = ((self.local.view(-1, 1) - 1 + self.delays.view(1, -1)) % self.CT)[..., None]
        return self.cache.gather(2, cols)[..., 0], self.local > self.max_delay

    def advance(self, rows: torch.Tensor) -> None:
        self.local += rows.long()
