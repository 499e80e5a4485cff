"""Who holds which slot, who waits for one and why, and whom to shed: the slot pool's seating, without
the ticking. A free slot is necessary, not enough: with admission by headroom, one more row must also fit
the measured tick (`HeadroomPolicy`, serving/headroom.py). Not thread-safe: the pool holds its lock around
every use, so a decision and the seating it leads to happen together.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .call import Call
from .config import PoolConfig
from .headroom import HeadroomPolicy, WaitReason
from .metrics import PoolCounters
from .pacing import Clock
from .room import CallState, PoolFullError


class SlotTable:
    """`bucket`: the batch the engine steps for a number of calls (LockstepEngine.bucket), by which the
    headroom curve prices one more call; None where the engine steps every call as a row."""

    def __init__(self, slots: int, config: PoolConfig, clock: Clock, counters: PoolCounters,
                 bucket: Callable[[int], int] | None = None) -> None:
        self.slots: list[Call | None] = [None] * slots
        self.queue: collections.deque[Call] = collections.deque()
        self.config = config
        self.policy = HeadroomPolicy(config, bucket)
        self._clock = clock
        self._counters = counters

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

    def fits(self) -> bool:
        """May one more call join the rows held? With admission by slots: always."""
        return not self.config.by_headroom or self.policy.admits(self._clock.monotonic(), self.rows_held)

    def place(self, call: Call, may_queue: bool) -> None:
        """Seat `call` on a free slot if one more row fits, else queue it; PoolFullError when the queue is
        full (`may_queue=False`: when it would wait). Newcomers never jump the queue, even if a slot is
        free for an instant."""
        free = self._free()
        if free is not None and not self.queue and self.fits():
            self._seat(free, call)
            return
        cause, max_queue = self.wait_reason(), self.config.max_queue
        if may_queue and (max_queue is None or len(self.queue) < max_queue):
            self.queue.append(call)
            call.set_queue_position(len(self.queue), cause)
            self._count_held_back()
            return
        why = cause if cause == WaitReason.CAPACITY else f"all {len(self.slots)} slots busy"
        if not may_queue:
            raise PoolFullError(why, cause)
        self._counters.calls_refused += 1
        raise PoolFullError(f"{why} and the queue of {max_queue} is full; try again in a minute", cause)

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

    def seat_waiting(self) -> list[Call]:
        """Seat the queue's head on free slots while one more row fits; the rest learn their new place
        and why they wait. The calls seated, in order."""
        if not self.queue:
            return []
        seated = []
        while self.queue and (free := self._free()) is not None and self.fits():
            head = self.queue.popleft()
            self._seat(free, head)
            seated.append(head)
        self._renumber(self.wait_reason())
        self._count_held_back()
        return seated

    def _seat(self, slot: int, call: Call) -> None:
        self.slots[slot] = call
        call.assign(slot)

    def waiting_prefills(self) -> list[tuple[int, Call]]:
        """Seated calls whose prompt nobody plays yet, in slot order (`Call.claim_prefill` claims one)."""
        return [(s, c) for s, c in enumerate(self.slots) if c is not None and c.prefill_waiting]

    def wait_reason(self) -> WaitReason:
        """CAPACITY only when a slot is free and one more row does not fit (a slot freed a moment ago,
        before the ticker seats the head, is not that)."""
        return WaitReason.CAPACITY if self._free() is not None and not self.fits() else WaitReason.SLOTS

    def _renumber(self, reason: WaitReason | None = None) -> None:
        """Queue positions from 1; each keeps its reason unless one is given."""
        for position, waiting in enumerate(self.queue, start=1):
            waiting.set_queue_position(position, reason or waiting.wait_reason or WaitReason.SLOTS)

    def _count_held_back(self) -> None:
        """Count each queued call once, the first time it waits with a slot free."""
        for call in self.queue:
            if call.wait_reason == WaitReason.CAPACITY and not call.held_back:
                call.held_back = True
                self._counters.calls_held_back += 1

    def to_shed(self) -> Call | None:
        """The call to end now because the room is overloaded: the newest live one, or None."""
        live = [c for _, c in self.seated(CallState.LIVE)]
        if not self.policy.shed_due(self._clock.monotonic(), len(live)):
            return None
        return max(live, key=lambda c: c.live_since or 0.0)

    def figures(self) -> dict[str, Any]:
        """`PoolMetrics`'s fields of who sits where, and whether one more caller would be seated now."""
        now, states = self._clock.monotonic(), [c.state for c in self.slots if c is not None]
        free = len(self.slots) - len(states)
        by_door = collections.Counter(c.door for c in self.everyone() if c.state != CallState.ENDED)
        return dict(slots_total=len(self.slots), slots_live=states.count(CallState.LIVE),
                    slots_prefill=states.count(CallState.PREFILL), slots_free=free,
                    queue_length=len(self.queue), calls_by_door=dict(by_door),
                    admitting=int(free > 0 and self.fits()), media_lag_ms=self.policy.media_lag(now) * 1e3,
                    headroom_ms=self.policy.headroom(now, self.rows_held) * 1e3)
