"""Which batch row holds which slot's conversation, and how many rows a tick steps
(docs/engine.md § Ticks sized by the live calls). Torch-free bookkeeping on the engine thread.
"""

from __future__ import annotations

import numpy as np


def batch_buckets(slots: int) -> list[int]:
    """The batch sizes a tick runs at: the powers of two below `slots`, and `slots` itself.
    Few enough for one CUDA graph each, and never more than twice the rows in use."""
    buckets, size = [], 1
    while size < slots:
        buckets.append(size)
        size *= 2
    return [*buckets, slots]


def batch_bucket(rows: int, buckets: list[int]) -> int:
    """The smallest bucket of `buckets` (ascending) that holds `rows` rows (at least the first)."""
    return next((b for b in buckets if b >= rows), buckets[-1])


class RowPlaces:
    """The slot <-> row map of one engine; not thread-safe (the engine thread owns it)."""

    def __init__(self, slots: int) -> None:
        self.row_of: list[int | None] = [None] * slots  # by slot
        self.slot_at: list[int | None] = [None] * slots  # by row

    @property
    def held(self) -> int:
        """Rows that hold a conversation."""
        return sum(1 for s in self.slot_at if s is not None)

    @property
    def top(self) -> int:
        """One past the highest row that holds a conversation (0 when none does)."""
        return next((r + 1 for r in reversed(range(len(self.slot_at))) if self.slot_at[r] is not None), 0)

    def take(self, slot: int) -> int:
        """The row of `slot`: the one it holds, or the lowest free row."""
        row = self.row_of[slot]
        if row is None:
            row = self.slot_at.index(None)
            self.row_of[slot], self.slot_at[row] = row, slot
        return row

    def free(self, slot: int) -> int | None:
        """Give `slot`'s row back; the row it held, if any."""
        row = self.row_of[slot]
        if row is not None:
            self.row_of[slot] = self.slot_at[row] = None
        return row

    def compaction(self, buckets: list[int]) -> list[tuple[int, int]]:
        """The moves (from row, to row) that bring every conversation into the bucket their number
        needs, highest row into lowest free row, applied to the map; none while the bucket of
        the highest row is already that bucket. A move copies one row's state once, about what one
        tick reads of it; carrying a bigger bucket costs the extra rows on every tick."""
        moves: list[tuple[int, int]] = []
        need = batch_bucket(self.held, buckets)
        while batch_bucket(self.top, buckets) > need:
            src, dst = self.top - 1, self.slot_at.index(None)
            slot = self.slot_at[src]
            assert slot is not None and dst < src
            self.slot_at[dst], self.slot_at[src], self.row_of[slot] = slot, None, dst
            moves.append((src, dst))
        return moves

    def slots_in(self, rows: int) -> np.ndarray:
        """The slot of each of the first `rows` rows, -1 where a row holds none."""
        return np.array([-1 if s is None else s for s in self.slot_at[:rows]], dtype=np.int64)
