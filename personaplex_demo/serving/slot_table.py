"""Who holds which slot, and who waits for one: the slot pool's seating, without the ticking.

Not thread-safe: the pool holds its lock around every use.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from .call import Call
from .counters import SlotCounts
from .room import CallState


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

    def admit(self, call: Call, may_queue: bool, max_queue: int | None) -> bool:
        """Seat `call` on a free slot or at the end of the queue; False if neither is allowed.
        Newcomers never jump the queue, even if a slot is free for an instant."""
        free = next((i for i, occupant in enumerate(self.slots) if occupant is None), None)
        if free is not None and not self.queue:
            self.slots[free] = call
            call.assign(free)
            return True
        if not may_queue or (max_queue is not None and len(self.queue) >= max_queue):
            return False
        self.queue.append(call)
        call.set_queue_position(len(self.queue))
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

    def vacate(self, slot: int, seat_next: bool) -> None:
        """Empty `slot`; with `seat_next`, the head of the queue takes it."""
        self.slots[slot] = None
        if seat_next and self.queue:
            head = self.queue.popleft()
            self.slots[slot] = head
            head.assign(slot)
            self._renumber()

    def waiting_prefills(self) -> list[tuple[int, Call]]:
        """Seated calls whose prompt nobody plays yet, in slot order (`Call.claim_prefill` claims one)."""
        return [(s, c) for s, c in enumerate(self.slots) if c is not None and c.prefill_waiting]

    def _renumber(self) -> None:
        for position, waiting in enumerate(self.queue, start=1):
            waiting.set_queue_position(position)

    def counts(self) -> SlotCounts:
        states = [c.state for c in self.slots if c is not None]
        return SlotCounts(total=len(self.slots), live=states.count(CallState.LIVE),
                          prefill=states.count(CallState.PREFILL), free=len(self.slots) - len(states),
                          queued=len(self.queue))
