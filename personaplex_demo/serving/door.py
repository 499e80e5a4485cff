"""What every door does with a call, written once: ask the room for it, follow it through the queue
and the prefill, pass audio in and frames out, end it. A door is a protocol adapter on a `DoorCall`:
it renders a `Refusal` and `next_event`'s events, and decides nothing the room decides.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import numpy as np

from ..call_settings import SamplingParams
from ..errors import CallerError
from .headroom import WaitReason
from .room import CallEnded, CallHandle, CallState, EndReason, PoolClosedError, PoolFullError, Room, SlotOutput


class RefusalKind(enum.StrEnum):
    CALLER = "caller"  # a bad request: the caller's to fix (unknown voice, persona too long...)
    FULL = "full"  # no seat and no place in the queue: try again later
    CLOSED = "closed"  # the room takes no calls (shutting down, no engine)


@dataclass(frozen=True)
class Refusal:
    """Why a call could not start, as a value a door renders."""

    kind: RefusalKind
    error: Exception  # the room's exception: its message, and its class for a door that names it

    @property
    def cause(self) -> WaitReason | None:
        """FULL: what is short, the slots or the machine's capacity."""
        return self.error.cause if isinstance(self.error, PoolFullError) else None


@dataclass(frozen=True)
class Queued:
    position: int | None
    reason: WaitReason | None


@dataclass(frozen=True)
class Preparing:
    """Seated: the voice and persona are being played into the slot."""


@dataclass(frozen=True)
class Live:
    time_left: float | None


@dataclass(frozen=True)
class Frame:
    out: SlotOutput


@dataclass(frozen=True)
class Ended:
    reason: str  # an EndReason; "hangup" when the caller (or the door for it) hung up


DoorEvent = Queued | Preparing | Live | Frame | Ended
WAIT_LOOK_SECONDS = 0.2  # how soon a waiting caller hears that its place changed


class DoorCall:
    """One caller's call as a door drives it; see the module docstring. On the door's event loop."""

    def __init__(self, room: Room, door: str) -> None:
        self.room = room
        self.door = door
        self.call: CallHandle | None = None
        self._told: tuple | None = None  # the last state news given (next_event gives each once)

    async def start(self, voice: str, persona: str, sampling: SamplingParams) -> Refusal | None:
        """Ask the room for a call; None once it holds one (seated or queued), else why not."""
        try:
            self.call = await self.room.acquire(voice, persona, sampling, door=self.door)
        except CallerError as exc:
            return Refusal(RefusalKind.CALLER, exc)
        except PoolFullError as exc:
            return Refusal(RefusalKind.FULL, exc)
        except PoolClosedError as exc:
            return Refusal(RefusalKind.CLOSED, exc)
        return None

    @property
    def state(self) -> CallState | None:
        return self.call.state if self.call is not None else None

    def push(self, samples: np.ndarray) -> None:
        """The caller's audio as it arrived: heard while live; while queued it is checked and
        dropped (the model is not listening yet), so a door need not push then."""
        if self.call is not None and self.call.state in (CallState.LIVE, CallState.QUEUED):
            self.call.push_audio(samples)

    def hang_up(self, reason: str = EndReason.HANGUP) -> None:
        if self.call is not None:
            self.call.release(reason)

    async def next_event(self, timeout: float) -> DoorEvent | None:
        """What the door has to pass on next: news of the call's state (each change once: its
        place in the queue, preparing, live, its end), else the next agent frame; None when
        `timeout` s passed without any."""
        call = self.call
        if call is None:
            raise RuntimeError("next_event before the call started")
        if (news := self._news()) is not None:
            return news
        if call.state.waiting:
            return await self._wait(call, timeout)
        try:
            out = await call.next_output(timeout)
        except CallEnded:
            return self._news(drained=True)
        return Frame(out) if out is not None else self._news()

    async def _wait(self, call: CallHandle, timeout: float) -> DoorEvent | None:
        """While the call waits: the first news, looked at every WAIT_LOOK_SECONDS (a place changes
        without waking `wait_live`). An end is left for the next call, which drains frames first."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                await call.wait_live(min(left, WAIT_LOOK_SECONDS))
            except (TimeoutError, CallEnded):
                pass
            if (news := self._news()) is not None or not call.state.waiting:
                return news
        return None

    def _news(self, drained: bool = False) -> DoorEvent | None:
        """The call's state, if the door was not told it yet. An end is news once the frames
        before it have been read (`drained`)."""
        call = self.call
        assert call is not None
        state = call.state
        if state == CallState.ENDED and not drained:
            return None
        if state == CallState.QUEUED:
            now: tuple = (state, call.queue_position, call.wait_reason)
        else:
            now = (state, call.end_reason if state == CallState.ENDED else None)
        if now == self._told:
            return None
        self._told = now
        if state == CallState.QUEUED:
            return Queued(call.queue_position, call.wait_reason)
        if state == CallState.PREFILL:
            return Preparing()
        if state == CallState.LIVE:
            return Live(call.time_left())
        return Ended(call.end_reason or "ended")
