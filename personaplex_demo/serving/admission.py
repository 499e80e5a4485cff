"""Who is seated, who waits and why, and whom to shed: `HeadroomPolicy` (serving/headroom.py)
applied to the pool's `SlotTable`. Not thread-safe: the pool holds its lock around every use, so a
decision and the seating it leads to happen together.
"""

from __future__ import annotations

from collections.abc import Callable

from .call import Call
from .clock import Clock
from .config import PoolConfig
from .counters import PoolCounters
from .headroom import HeadroomPolicy, WaitReason
from .metrics import AdmissionFigures
from .room import CallState, PoolFullError
from .slot_table import SlotTable


class Admission:
    """`bucket`: the batch the engine steps for a number of calls (LockstepEngine.bucket), by
    which the headroom curve prices one more call; None where the engine steps every call as a row."""

    def __init__(self, config: PoolConfig, clock: Clock, table: SlotTable, counters: PoolCounters,
                 bucket: Callable[[int], int] | None = None) -> None:
        self.config = config
        self.policy = HeadroomPolicy(config.headroom(), bucket)
        self._clock = clock
        self._table = table
        self._counters = counters

    def fits(self, rows: int) -> bool:
        """May one more call join `rows` held rows? With admission by slots: always."""
        return not self.config.by_headroom or self.policy.admits(self._clock.monotonic(), rows)

    def place(self, call: Call, may_queue: bool) -> None:
        """Seat `call` or queue it; PoolFullError when the queue is full (`may_queue=False`: when it would wait)."""
        if self._table.admit(call, may_queue, self.config.max_queue, self.fits):
            self._count_held_back()
            return
        cause = self._table.wait_reason(self.fits)
        why = cause if cause == WaitReason.CAPACITY else f"all {len(self._table)} slots busy"
        if not may_queue:
            raise PoolFullError(why, cause)
        self._counters.calls_refused += 1
        raise PoolFullError(f"{why} and the queue of {self.config.max_queue} is full; try again in a minute", cause)

    def seat_waiting(self) -> list[Call]:
        """Seat the queue's head on free slots while one more row fits."""
        if not self._table.queue:
            return []
        seated = self._table.seat_waiting(self.fits)
        self._count_held_back()
        return seated

    def record_media_lag(self, source: str, seconds: float) -> None:
        self.policy.record_media_lag(self._clock.monotonic(), source, seconds)

    def to_shed(self) -> Call | None:
        """The call to end now because the room is overloaded: the newest live one, or None."""
        live = [c for _, c in self._table.seated(CallState.LIVE)]
        if not self.policy.shed_due(self._clock.monotonic(), len(live)):
            return None
        return max(live, key=lambda c: c.live_since or 0.0)

    def figures(self, slots_free: int) -> AdmissionFigures:
        now, rows = self._clock.monotonic(), self._table.rows_held
        return AdmissionFigures(headroom_ms=self.policy.headroom(now, rows) * 1e3,
                                admitting=int(slots_free > 0 and self.fits(rows)),
                                media_lag_ms=self.policy.media_lag(now) * 1e3)

    def _count_held_back(self) -> None:
        """Count each queued call once, the first time it waits with a slot free."""
        for call in self._table.queue:
            if call.wait_reason == WaitReason.CAPACITY and not call.held_back:
                call.held_back = True
                self._counters.calls_held_back += 1
