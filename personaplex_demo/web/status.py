"""What a caller's page shows of the room and of their call: the status line, the room's figures
(shared by every page, at most twice a second), and when an update is worth sending."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..serving.headroom import WaitReason
from ..serving.metrics import PoolMetrics
from ..serving.room import DOOR_PAGE, CallHandle, CallState, Room

# Each page update costs the server a data-channel message and a Gradio event step, per caller:
# new text is batched to at most one update per TEXT_SECONDS, and the status line (time left,
# queue position, room) is looked at once per STATUS_SECONDS and sent only when it changed.
STATUS_SECONDS = 1.0
TEXT_SECONDS = 0.5


class SharedFigures:
    """One room's `snapshot()`, shared by its handlers and page refreshes and taken at most every `ttl`
    seconds: a snapshot sorts thousands of samples under the ticker's lock."""

    def __init__(self, room: Room, ttl: float = 0.5) -> None:
        self.room, self.ttl = room, ttl
        self._lock = threading.Lock()
        self._taken: tuple[float, PoolMetrics] | None = None

    def get(self) -> PoolMetrics:
        now = time.monotonic()
        with self._lock:
            if self._taken is not None and now - self._taken[0] < self.ttl:
                return self._taken[1]
        metrics = self.room.snapshot()
        with self._lock:
            self._taken = (now, metrics)
        return metrics


def queue_reason(m: PoolMetrics) -> str | None:
    """Why callers wait (None when nobody does): every slot is held, or a slot is free and the tick
    has no room for one more (serving/headroom.py)."""
    if not m.queue_length:
        return None
    return WaitReason.CAPACITY if m.slots_free and not m.admitting else WaitReason.SLOTS


def limited_by(m: PoolMetrics, media_lag_limit_seconds: float, slots_bound: str | None = None) -> str | None:
    """What keeps the next caller out now (None: nothing): every slot held, their number set by the
    device's memory ("memory", `SlotPlan.bound`) or a setting ("slots"); the engine's tick, whose next
    size would not fit its budget ("tick"); or a door's event loop that lags ("media")."""
    if m.slots_free == 0:
        return "memory" if slots_bound == "memory" else "slots"
    if m.admitting:
        return None
    return "media" if m.media_lag_ms > 1e3 * media_lag_limit_seconds else "tick"


def room_line(m: PoolMetrics, holding: int = 0) -> str:
    """The room's figures in a few words. `holding`: slots the reader's own call holds, which the
    figures (shared, up to half a second old) may not count yet."""
    room = f"slots {max(m.slots_live + m.slots_prefill, holding)}/{m.slots_total} in use"
    if m.queue_length:
        room += f", {m.queue_length} waiting"
    if api := sum(count for door, count in m.calls_by_door.items() if door != DOOR_PAGE):
        room += f" ({api} via the API)"
    return room


def status_line(call: CallHandle | None, room: SharedFigures) -> str:
    """One line for the page: the call's state (preparing / live with time left / queued) and the room."""
    holds = call is not None and call.state in (CallState.PREFILL, CallState.LIVE)
    figures = room_line(room.get(), holding=int(holds))
    if call is None:
        return f"Connecting… · {figures}"
    if call.state == CallState.QUEUED:
        why = (call.wait_reason or WaitReason.SLOTS).capitalize()
        return f"{why}: you are number {call.queue_position} in the queue · {figures}"
    if call.state == CallState.PREFILL:
        return f"Preparing your voice and persona… · {figures}"
    if call.state == CallState.LIVE:
        left = call.time_left()
        tail = f" · {int(left // 60)}:{int(left % 60):02d} left" if left is not None else ""
        return f"Live{tail} · {figures}"
    return f"Call ended ({call.end_reason}) · {figures}"


class PageThrottle:
    """When a page update is due: new text at most every TEXT_SECONDS, a changed status line at
    most every STATUS_SECONDS, and nothing that would repeat the previous update."""

    def __init__(self) -> None:
        self.last_status = ""
        self.last_at = 0.0
        self.text_pending = False  # transcript text not yet sent to the page

    def take(self, text_changed: bool, status_due: bool, status: Callable[[], str]) -> str | None:
        """The status line to send now with the transcript, or None. `status_due` (while waiting
        for a slot) looks at the status now; `status` is only called when an update could be due."""
        now = time.monotonic()
        self.text_pending |= text_changed
        since = now - self.last_at
        if not status_due and since < (TEXT_SECONDS if self.text_pending else STATUS_SECONDS):
            return None
        line = status()
        if not self.text_pending and line == self.last_status:
            return None
        self.text_pending = False
        self.last_status, self.last_at = line, now
        return line
