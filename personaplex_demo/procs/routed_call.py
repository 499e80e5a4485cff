"""A call waiting in a `PoolRouter`'s queue: one queue in front of every engine.

When no engine can seat a caller now, the router keeps the call itself rather than queueing it
at one engine: a slot that frees on any engine then goes to the head of this one queue, and the
caller sees one position, the same wherever the slot will be. Until an engine seats it the call
is a `RoutedCall` in state QUEUED; from then on every question goes to the engine's own call
(`RemoteCall`). Either way it is the `CallHandle` the door holds. Everything happens on the
door's event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import numpy as np

from ..sampling_params import SamplingParams
from ..serving.call import checked_audio
from ..serving.headroom import WAIT_SLOTS
from ..serving.room import CallEnded, CallState, EndReason, SlotOutput

if TYPE_CHECKING:
    from .remote_pool import RemoteCall


class RoutedCall:
    """A `CallHandle` for a caller in the router's queue, and then for its call on an engine."""

    def __init__(self, voice: str, persona: str, sampling: SamplingParams, door: str) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.door = door
        self.voice, self.persona, self.sampling = voice, persona, sampling
        self.inner: RemoteCall | None = None
        self.position: int | None = None  # in the router's queue, 1 = next
        self.waiting_for = WAIT_SLOTS  # the router says whether slots or tick headroom are short
        self.held_back = False  # counted once as waiting for headroom
        self._ended: str | None = None
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"RoutedCall({self.id}, {self.state}, queue={self.queue_position}, on={self.inner!r})"

    @property
    def state(self) -> CallState:
        if self.inner is not None:
            return self.inner.state
        return CallState.ENDED if self._ended is not None else CallState.QUEUED

    @property
    def queue_position(self) -> int | None:
        return self.position if self.state == CallState.QUEUED else None

    @property
    def wait_reason(self) -> str | None:
        return self.waiting_for if self.state == CallState.QUEUED else None

    @property
    def slot(self) -> int | None:
        return self.inner.slot if self.inner is not None else None

    @property
    def end_reason(self) -> str | None:
        return self.inner.end_reason if self.inner is not None else self._ended

    # ---- the router's side ---------------------------------------------------------------------

    def seat(self, inner: RemoteCall) -> None:
        self.inner = inner
        self._wake()

    def end(self, reason: str) -> None:
        if self.inner is None and self._ended is None:
            self._ended = reason
            self._wake()

    def moved(self) -> None:
        """Its place in the queue (or why it waits) changed."""
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ---- the door's side -----------------------------------------------------------------------

    def push_audio(self, samples: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.push_audio(samples)
        else:
            checked_audio(samples)  # bad audio is the caller's error at any time

    def time_left(self) -> float | None:
        return self.inner.time_left() if self.inner is not None else None

    def release(self, reason: str = EndReason.HANGUP) -> None:
        if self.inner is not None:
            self.inner.release(reason)
        else:
            self.end(reason)  # the router drops it from its queue

    async def wait_live(self, timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.inner is None:
            if self._ended is not None:
                raise CallEnded(self._ended)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            await asyncio.wait_for(self._changed.wait(), remaining)
        await self.inner.wait_live(None if deadline is None else max(0.0, deadline - loop.time()))

    async def next_output(self, timeout: float) -> SlotOutput | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inner is None:
            if self._ended is not None:
                raise CallEnded(self._ended)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return None
        return await self.inner.next_output(max(0.0, deadline - loop.time()))
