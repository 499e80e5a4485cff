"""The room contract: what every door needs of a room of conversation slots, and what every back end
(a `SlotPool`, a `PoolRouter` over engine processes) provides; a door is typed against `Room` and
`CallHandle` only (docs/serving.md § The room contract). Torch-free: numpy frames in and out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..call_settings import SamplingParams
from .config import PoolConfig
from .headroom import WaitReason
from .metrics import PoolMetrics, TickListener

# The door a call came through, a label the room only counts by (/api/status, /metrics): the
# WebRTC page's (web/handler.py), or an API door's kind (api/doors.py's table).
DOOR_PAGE = "page"


class CallState(enum.StrEnum):
    QUEUED = "queued"  # waiting for a free slot
    PREFILL = "prefill"  # holds a slot; the voice and persona prompt is being played into it
    LIVE = "live"  # stepped every tick
    ENDED = "ended"  # for good; the slot stays held until the engine has dropped the session

    @property
    def waiting(self) -> bool:
        """Not live yet, not ended: the caller sees a queue position or "preparing"."""
        return self in (CallState.QUEUED, CallState.PREFILL)


class EndReason(enum.StrEnum):
    """Why a call ended. An engine failure is "error: <details>" (see `error`), counted as ERROR."""

    HANGUP = "hangup"
    IDLE = "idle"  # no input frame for `idle_release_seconds`
    TIME_LIMIT = "time_limit"
    QUEUE_TIMEOUT = "queue_timeout"
    OVERLOADED = "overloaded"  # shed so that the calls before it keep real time (serving/headroom.py)
    SHUTDOWN = "shutdown"
    NOT_READING = "not_reading"  # the client stopped reading its audio (an API door, api/)
    ERROR = "error"

    @staticmethod
    def error(detail: object) -> str:
        return f"error: {detail}"

    @staticmethod
    def kind(reason: str) -> str:
        """The counter a reason goes under: "error: ..." counts as "error"."""
        return reason.partition(":")[0]


# What a call's end means to its caller, in words any door can show (the page adds what to press,
# an API door a close code). A failure ("error: <details>") says what failed.
END_MESSAGES = {
    EndReason.TIME_LIMIT: "Time is up for this call. Thanks for talking!",
    EndReason.IDLE: "No audio arrived from the caller for a few seconds, so the call was ended.",
    EndReason.SHUTDOWN: "The server is restarting. Please try again in a minute.",
    EndReason.QUEUE_TIMEOUT: "Still no place in the room after a long wait, sorry. Please try again in a few minutes.",
    EndReason.OVERLOADED: ("The room is overloaded: this machine could no longer keep every call in real time, "
                           "so the newest call was ended. Please try again in a few minutes."),
    EndReason.NOT_READING: "The client stopped reading its audio, so the call was ended.",
}


def end_message(reason: str) -> str:
    """The words for a call the room ended (not a hang-up): the table's, or what failed."""
    if reason in END_MESSAGES:
        return END_MESSAGES[reason]
    if EndReason.kind(reason) == EndReason.ERROR and reason != EndReason.ERROR:
        return f"The call ended: {reason.partition(':')[2].strip()}."
    return f"The call ended: {reason}."


class CallEnded(Exception):
    """The call has ended (and, for `next_output`, every output has been read)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"call ended: {reason}")
        self.reason = reason


class PoolFullError(Exception):
    """No seat now, and no place in the queue (it is full, or the caller asked not to wait).
    `cause`: what is short, the slots or the machine's capacity (a typed value, for the doors)."""

    def __init__(self, message: str, cause: WaitReason = WaitReason.SLOTS) -> None:
        super().__init__(message)
        self.cause = WaitReason(cause)


class PoolClosedError(Exception):
    """The room has been shut down, or no engine behind it is running."""


@dataclass
class SlotOutput:
    pcm: np.ndarray  # float32, one frame of agent audio at 24 kHz
    text: str  # transcript text that became final this tick ("" if none)
    tick: int
    # Seconds from the newest sample of the caller's input frame reaching the room to this answer
    # to it; None when no input was there and silence stood in for it.
    latency: float | None = None
    input_drops: int = 0  # the call's input frames dropped so far (a full buffer, a resync)
    next_take: float | None = None  # when the pool plans its next tick (its clock): a client times its audio by it


@runtime_checkable
class CallHandle(Protocol):
    """One caller's call, as a door holds it. Non-blocking or awaitable: never blocks a loop."""

    id: str
    door: str  # the label of the door it came through
    state: CallState
    queue_position: int | None  # while QUEUED, 1 = next
    wait_reason: WaitReason | None  # while QUEUED: why
    slot: int | None
    end_reason: str | None  # once ENDED

    def push_audio(self, samples: np.ndarray) -> None:
        """Queue the caller's audio as it arrived: any number of samples up to a second (int16 or
        float, 24 kHz mono); the room cuts its frames at each tick. Dropped unless LIVE."""
        ...

    async def next_output(self, timeout: float) -> SlotOutput | None:
        """The next output frame; None after `timeout` s without one; CallEnded once ended and drained."""
        ...

    async def wait_live(self, timeout: float | None = None) -> None:
        """Return once LIVE; CallEnded if it ended first; TimeoutError after `timeout` s."""
        ...

    def time_left(self) -> float | None:
        """Seconds until the time limit; None without a limit or while not LIVE."""
        ...

    def release(self, reason: str = EndReason.HANGUP) -> None:
        """End the call (idempotent); the room frees its slot."""
        ...


@runtime_checkable
class Room(Protocol):
    """Slots shared by many callers, with one queue and one set of limits."""

    config: PoolConfig

    @property
    def slots_total(self) -> int: ...

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = ...,
                      door: str = DOOR_PAGE) -> CallHandle:
        """A call on a free slot (PREFILL) or in the queue (QUEUED), counted under `door`. Raises a
        CallerError for a bad request, PoolFullError when the queue is full, PoolClosedError after
        shutdown."""
        ...

    def snapshot(self) -> PoolMetrics:
        """The room's figures now (slots, queue, tick and latency percentiles, counters)."""
        ...

    def add_tick_listener(self, listener: TickListener) -> None:
        """Called with every tick's time and frame latencies (for /metrics); must be quick."""
        ...

    def report_media_lag(self, seconds: float, source: str = ...) -> None:
        """The door's event loop ran up to `seconds` late lately (its media falls behind);
        admission waits while any door lags. Never blocks."""
        ...
