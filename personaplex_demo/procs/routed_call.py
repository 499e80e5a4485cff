"""A call waiting in the room's one queue, in front of every engine (`pool_router.PoolRouter`): one
position, whichever engine frees a slot; once seated, the engine's own call (`RemoteCall`) answers for
it. Everything happens on the door's loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..call_settings import SamplingParams
from ..serving.call import checked_audio
from ..serving.headroom import WaitReason
from ..serving.room import CallState, EndReason, PoolClosedError, PoolFullError, SlotOutput
from ..serving.waiting import WaitingCall

if TYPE_CHECKING:
    from .engine_link import EngineLink, RemoteCall


class RoutedCall(WaitingCall):
    """A `CallHandle` for a caller in the room's queue, and then for its call on an engine."""

    def __init__(self, voice: str, persona: str, sampling: SamplingParams, door: str) -> None:
        super().__init__()
        self.id = uuid.uuid4().hex[:12]
        self.door = door
        self.voice, self.persona, self.sampling = voice, persona, sampling
        self.inner: RemoteCall | None = None
        self.position: int | None = None  # in the room's queue, 1 = next
        self.waiting_for = WaitReason.SLOTS  # the room says whether slots or tick headroom are short
        self.held_back = False  # counted once as waiting for headroom
        self.arrival = 0  # the room's order of arrival: first come, first served
        self.queued_at = time.monotonic()
        self.on_leave: Callable[[str], None] | None = None  # told when the caller gives up its place
        self._ended: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id}, {self.state}, queue={self.queue_position}, on={self.inner!r})"

    @property
    def state(self) -> CallState:
        if self.inner is not None:
            return self.inner.state
        return CallState.ENDED if self._ended is not None else CallState.QUEUED

    @property
    def queue_position(self) -> int | None:
        return self.position if self.state == CallState.QUEUED else None

    @property
    def wait_reason(self) -> WaitReason | None:
        return self.waiting_for if self.state == CallState.QUEUED else None

    @property
    def slot(self) -> int | None:
        return self.inner.slot if self.inner is not None else None

    @property
    def end_reason(self) -> str | None:
        return self.inner.end_reason if self.inner is not None else self._ended

    # ---- the room's side -----------------------------------------------------------------------

    async def take(self, engine: EngineLink, index: int) -> bool:
        """Take a seat on `engine` (number `index` of the room's) if it has one now: True when this caller
        needs no more seating (seated, or gone meanwhile). CallerError for a request the engine refuses."""
        if self.state == CallState.ENDED:
            return True  # it left meanwhile: nothing to seat
        try:
            inner = await engine.acquire(self.voice, self.persona, self.sampling, self.door, queue=False)
        except (PoolFullError, PoolClosedError):
            return False
        if self.state == CallState.ENDED:  # hung up while the engine was seating it
            inner.release(self.end_reason or EndReason.HANGUP)
            return True
        self.inner = inner
        inner.on_change = self._wake  # a door waiting here hears the engine's news
        self._wake()
        return True

    def end(self, reason: str) -> None:
        if self.inner is None and self._ended is None:
            self._ended = str(reason)
            self._wake()

    def moved(self, position: int, reason: WaitReason) -> bool:
        """Its place in the queue, or why it waits; True if either changed."""
        if (self.position, self.waiting_for) == (position, reason):
            return False
        self.position, self.waiting_for = position, WaitReason(reason)
        self._wake()
        return True

    # ---- the door's side -----------------------------------------------------------------------

    def push_audio(self, samples: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.push_audio(samples)
            return
        checked_audio(samples)  # bad audio is the caller's error at any time; unheard until seated

    def time_left(self) -> float | None:
        return self.inner.time_left() if self.inner is not None else None

    def release(self, reason: str = EndReason.HANGUP) -> None:
        if self.inner is not None:
            self.inner.release(reason)
        elif self._ended is None:
            self.end(reason)  # the room drops it from its queue
            if self.on_leave is not None:
                self.on_leave(str(reason))

    def _next_output(self) -> SlotOutput | None:
        return self.inner._next_output() if self.inner is not None else None

