"""The ring KV cache shared by every streaming transformer here, and the ring-position rule,
written once (docs/model.md § The ring rule). Key j of a row lives in slot j % C. Also
`RowStates`, the per-row reset, head and move of every streaming state, model and engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Self

import torch
from torch import Tensor


def ring_positions(end: Tensor, capacity: int, slots: int | None = None) -> Tensor:
    """Stream position held by each slot (the first `slots` of them) of rings of `capacity`
    after `end` [B] keys were written, -1 where empty: [B, slots]. With `delta <= 0` a wrapped
    ring shows capacity - 1 keys, not capacity: the reference's rule, kept for token parity."""
    end = end.view(-1, 1)
    idx = torch.arange(capacity if slots is None else slots, device=end.device).view(1, -1)
    delta = idx - end % capacity
    pos = torch.where(delta <= 0, end + delta, end + delta - capacity)
    return torch.where(idx >= end, torch.full_like(pos, -1), pos)


def ring_mask(query: Tensor, end: Tensor, capacity: int, context: int | None,
              slots: int | None = None) -> Tensor:
    """Boolean attention mask [B, 1, T, slots] of queries at stream positions `query` [B, T]
    over rings holding `end` [B] keys: a key is seen if it is in the ring, not in the future,
    and less than `context` steps back (None: no limit)."""
    pos_k = ring_positions(end, capacity, slots)[:, None, :]  # [B, 1, S]
    dist = query[:, :, None] - pos_k  # [B, T, S]
    mask = (pos_k >= 0) & (dist >= 0)
    if context is not None:
        mask = mask & (dist < context)
    # A query that sees nothing (a row that does not step and holds no key) would make the
    # softmax NaN; it sees slot 0 instead. Its output is never used.
    empty = ~mask.any(dim=-1, keepdim=True)
    mask = mask | (empty & (torch.arange(mask.shape[-1], device=mask.device) == 0))
    return mask[:, None]


def prefill_mask(length: int, capacity: int, context: int, device: torch.device | str) -> Tensor:
    """Causal mask [1, 1, L, L] of a parallel forward over the first `length` steps of one stream
    that equals stepping a ring of `capacity` one key at a time: query q sees the positions that
    `ring_mask` shows it once q + 1 keys are in the ring."""
    q = torch.arange(length, device=device)
    slots = min(capacity, length)  # a ring that has not wrapped holds nothing past `length`
    pos_k = ring_positions(q + 1, capacity, slots)  # [L, S]
    seen = ring_mask(q[:, None], q + 1, capacity, context, slots)[:, 0, 0]  # [L, S]
    mask = torch.zeros(length, length + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, torch.where(seen, pos_k, length), True)  # unseen slots go to a spare column
    return mask[None, None, :, :length]


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one (0 where seen, -inf elsewhere), built once rather
    than in every layer's call; rows 16 elements apart, or CUDA's memory-efficient attention copies it."""
    *lead, slots = mask.shape
    rows = torch.zeros(*lead, -(-slots // 16) * 16, dtype=dtype, device=mask.device)
    return rows[..., :slots].masked_fill_(~mask, float("-inf"))


class RowStates:
    """A dataclass of per-row streaming state: each field is a tensor [B, ...], None, a part with
    `reset_rows`, `head` and `move_row`, or a list of such parts; each method here does every field."""

    def _parts(self) -> list:
        values = [getattr(self, f.name) for f in fields(self)]
        return [p for v in values for p in (v if isinstance(v, list) else [v]) if p is not None]

    def reset_rows(self, mask: Tensor) -> None:
        """Make the rows of the bool mask `mask` [B] fresh: tensors zeroed, parts reset."""
        for p in self._parts():
            if isinstance(p, Tensor):
                p.masked_fill_(mask.view(-1, *[1] * (p.dim() - 1)), 0)
            else:
                p.reset_rows(mask)

    def head(self, rows: int) -> Self:
        """The first `rows` rows, sharing this state's storage (a smaller batch to step)."""
        def cut(v):
            if isinstance(v, list):
                return [cut(p) for p in v]
            return v[:rows] if isinstance(v, Tensor) else None if v is None else v.head(rows)
        return replace(self, **{f.name: cut(getattr(self, f.name)) for f in fields(self)})

    def move_row(self, src: int, dst: int) -> None:
        """Row `dst` continues row `src`'s streams; `src` is left as it was."""
        for p in self._parts():
            if isinstance(p, Tensor):
                p[dst] = p[src]
            else:
                p.move_row(src, dst)


@dataclass
class Attend:
    """What every layer of one forward shares."""

    positions: Tensor | None  # [B, T] stream positions of the new steps (RoPE); None: no RoPE
    mask: Tensor  # additive [B or 1, 1, T, S] (see `additive`): the slots each new step sees
    slots: Tensor | int  # [B, T] ring slots of the new keys, or one slot for every row
    visible: int | None = None  # attend the first `visible` slots only (None: all)


@dataclass
class RingKV:
    """Ring KV caches of all layers of one transformer, with one end offset per batch row."""

    kv: Tensor  # [L, 2, B, H, C, Dh]
    end: Tensor  # [B] long: keys written to the row since its last reset

    def __post_init__(self) -> None:
        # Views of each layer's slice; not a field, so that walking the fields counts each tensor once.
        self.layers = [RingLayer(self.kv[i]) for i in range(self.kv.shape[0])]

    @classmethod
    def empty(cls, layers: int, batch: int, heads: int, capacity: int, head_dim: int,
              device: torch.device | str, dtype: torch.dtype) -> RingKV:
        kv = torch.zeros(layers, 2, batch, heads, capacity, head_dim, device=device, dtype=dtype)
        return cls(kv, torch.zeros(batch, device=device, dtype=torch.long))

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def reset_rows(self, rows: Tensor) -> None:
        """Make the rows of the bool mask `rows` [B] empty rings. Their slots are zeroed, not only
        hidden by `end = 0`: a hidden NaN or inf would still enter the attention as 0 x value."""
        self.kv.index_fill_(2, rows.nonzero()[:, 0], 0.0)
        self.end.masked_fill_(rows, 0)

    def head(self, rows: int) -> RingKV:
        """The first `rows` rows, sharing this cache's storage: stepping it steps them."""
        return RingKV(self.kv[:, :, :rows], self.end[:rows])

    def move_row(self, src: int, dst: int) -> None:
        """Row `dst` becomes what row `src` is (every layer's ring and the end); `src` is left as it was."""
        self.kv[:, :, dst] = self.kv[:, :, src]
        self.end[dst] = self.end[src]

    def advance(self, steps: int, context: int | None, active: Tensor | None = None,
                visible: int | None = None) -> Attend:
        """Take `steps` new keys per row (only rows where `active` [B] is true; None: all) and
        return what the layers need to write and attend them. `visible`: attend only the first
        `visible` slots, exact when no stepping row holds more keys than that."""
        if visible is not None and visible >= self.capacity:
            visible = None
        start = self.end.clone()
        positions = start[:, None] + torch.arange(steps, device=start.device)  # [B, T]
        self.end += steps if active is None else active.long() * steps
        mask = additive(ring_mask(positions, self.end, self.capacity, context, visible), self.kv.dtype)
        # A row that does not step still writes its (unused) key, into slot end % C: the slot it
        # writes first when it steps again, so no later query of the row reads it (and a recycle
        # zeroes it). This saves gathering and re-writing the slot's old key in every layer.
        assert steps == 1 or active is None, "rows that do not step take one key per forward"
        return Attend(positions, mask, positions % self.capacity, visible)

    def load_row(self, row: int, kv: Tensor, length: int) -> None:
        """Install a stream prefix computed elsewhere: kv [L, 2, H, length, Dh], positions 0..length-1."""
        first = max(0, length - self.capacity)
        idx = torch.arange(first, length, device=self.kv.device) % self.capacity
        self.kv[:, :, row].index_copy_(3, idx, kv[:, :, :, first:length].to(self.kv.dtype))
        self.end[row] = length


@dataclass
class RingLayer:
    """The keys and values of one layer: a view [2, B, H, C, Dh] into a `RingKV`."""

    kv: Tensor

    def update(self, new: Tensor, attend: Attend) -> tuple[Tensor, Tensor]:
        """Write new keys and values [2, B, H, T, Dh] (one operator); return the slots to attend."""
        if isinstance(attend.slots, int):
            s = attend.slots
            self.kv[:, :, :, s:s + new.shape[3]] = new
        else:
            self.kv.scatter_(3, attend.slots[None, :, None, :, None].expand_as(new), new)
        kv = self.kv if attend.visible is None else self.kv[:, :, :, :attend.visible]
        return kv[0], kv[1]
