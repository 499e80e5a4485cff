"""Who holds which slot, and who waits for one: the slot pool's seating, without the ticking.
Whether one more row fits is the caller's question (`fits`, serving/headroom.py): a free slot is
necessary, not enough. Not thread-safe: the pool holds its lock around every use.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import numpy as np

from .call import Call
from .counters import SlotCounts
from .headroom import WaitReason
from .room import CallState

Fits = Callable[[int], bool]  # may one more call join this many rows held?


class SlotTable:
    def __init__(self, slots: int) -> None:
        self.slots: list[Call | None] = [None] * slots
        self.queue: collections.deque[Call] = collections.deque()

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def busy(self) -> bool:
        """A slot is held, or somebody waits for one."""
        return bool(self.queue) or any(c is not None for c in self.slots)

    @property
    def rows_held(self) -> int:
        """Calls that are, or are about to be, stepped every tick (live or being prepared)."""
        return sum(1 for c in self.slots if c is not None and c.state in (CallState.LIVE, CallState.PREFILL))

    def _free(self) -> int | None:
        return next((i for i, occupant in enumerate(self.slots) if occupant is None), None)

    def admit(self, call: Call, may_queue: bool, max_queue: int | None, fits: Fits) -> bool:
        """Seat `call` on a free slot if one more row fits, else queue it; False if neither is allowed.
        Newcomers never jump the queue, even if a slot is free for an instant."""
        free = self._free()
        if free is not None and not self.queue and fits(self.rows_held):
            self._seat(free, call)
            return True
        if not may_queue or (max_queue is not None and len(self.queue) >= max_queue):
            return False
        self.queue.append(call)
        call.set_queue_position(len(self.queue), self.wait_reason(fits))
        return True

    def end(self, call: Call, reason: str) -> bool:
        """End `call` (`Call.end`); a queued call leaves the queue. False if it had already ended."""
        was_queued = call.state == CallState.QUEUED
        if not call.end(reason):
            return False
        if was_queued and call in self.queue:
            self.queue.remove(call)
            self._renumber()
        return True

    def everyone(self) -> list[Call]:
        return [c for c in self.slots if c is not None] + list(self.queue)

    def seated(self, state: CallState) -> Iterator[tuple[int, Call]]:
        return ((slot, c) for slot, c in enumerate(self.slots) if c is not None and c.state == state)

    def take_frames(self, pcm: np.ndarray, now: float) -> tuple[list[tuple[int, Call, float | None]], dict[str, float]]:
        """Each live call's input frame into its row of `pcm` (silence where none came): the rows to
        step as (slot, call, push time of its frame), and each call's `Call.arrival_age` at `now`."""
        rows: list[tuple[int, Call, float | None]] = []
        ages: dict[str, float] = {}
        for slot, call in self.seated(CallState.LIVE):
            if (age := call.arrival_age(now)) is not None:
                ages[call.id] = age
            stamp, frame = call.take_frame()
            if frame is not None:
                pcm[slot] = frame
            rows.append((slot, call, stamp))
        return rows, ages

    def trim_backlogs(self, keep: int) -> int:
        """Cut every live call's input backlog to its `keep` newest frames; how many were dropped."""
        return sum(call.trim_backlog(keep) for _, call in self.seated(CallState.LIVE))

    def vacate(self, slot: int) -> None:
        self.slots[slot] = None

    def seat_waiting(self, fits: Fits) -> list[Call]:
        """Seat the queue's head on free slots while one more row fits; the rest learn their new place
        and why they wait. The calls seated, in order."""
        seated = []
        while self.queue and (free := self._free()) is not None and fits(self.rows_held):
            head = self.queue.popleft()
            self._seat(free, head)
            seated.append(head)
        self._renumber(self.wait_reason(fits))
        return seated

    def _seat(self, slot: int, call: Call) -> None:
        self.slots[slot] = call
        call.assign(slot)

    def waiting_prefills(self) -> list[tuple[int, Call]]:
        """Seated calls whose prompt nobody plays yet, in slot order (`Call.claim_prefill` claims one)."""
        return [(s, c) for s, c in enumerate(self.slots) if c is not None and c.prefill_waiting]

    def wait_reason(self, fits: Fits) -> WaitReason:
        """CAPACITY only when a slot is free and one more row does not fit (a slot freed a moment ago,
        before the ticker seats the head, is not that)."""
        return WaitReason.CAPACITY if self._free() is not None and not fits(self.rows_held) else WaitReason.SLOTS

    def _renumber(self, reason: WaitReason | None = None) -> None:
        """Queue positions from 1; each keeps its reason unless one is given."""
        for position, waiting in enumerate(self.queue, start=1):
            waiting.set_queue_position(position, reason or waiting.wait_reason or WaitReason.SLOTS)

    def counts(self) -> SlotCounts:
        states = [c.state for c in self.slots if c is not None]
        by_door = collections.Counter(c.door for c in self.everyone() if c.state != CallState.ENDED)
        return SlotCounts(total=len(self.slots), live=states.count(CallState.LIVE),
                          prefill=states.count(CallState.PREFILL), free=len(self.slots) - len(states),
                          queued=len(self.queue), by_door=dict(by_door))
