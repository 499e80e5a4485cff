"""What every back end's call does the same way: the handle's fields (`CallView`), and waiting for
its news (`wait_live`, `next_output`). A waiter looks and registers a future under the call's guard,
and `_wake`, under that guard, resolves them all: no wake-up is lost between a look and a wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable

from .config import PoolConfig
from .headroom import WaitReason
from .room import DOOR_PAGE, CallEnded, CallState, EndReason, SlotOutput


def queue_expiry(config: PoolConfig, now: float, queued_at: float) -> str | None:
    """The room's rules for a caller in its queue: why it must leave now, or None. Whichever room
    keeps the queue applies them, on its own clock."""
    if config.max_wait_seconds is not None and now - queued_at >= config.max_wait_seconds:
        return EndReason.QUEUE_TIMEOUT
    return None


class CallView:
    """What a door reads of a call (`room.CallHandle`'s fields), whichever back end holds it."""

    def __init__(self, call_id: str, door: str = DOOR_PAGE) -> None:
        self.id = call_id
        self.door = door
        self.state = CallState.QUEUED
        self.queue_position: int | None = None
        self.wait_reason: WaitReason | None = None  # while QUEUED: why
        self.slot: int | None = None
        self.end_reason: str | None = None  # once ENDED

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id}, {self.state}, slot={self.slot}, queue={self.queue_position})"


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class WaitingCall:
    """`wait_live` and `next_output` for every back end's call. A subclass keeps `state`, `end_reason`
    and its outputs (`_outbox`, at most `outbox_frames`: a full one loses its oldest), and calls `_wake`
    on every change, both under the guard."""

    state: CallState
    end_reason: str | None

    def __init__(self, guard: threading.Lock | None = None, outbox_frames: int | None = None) -> None:
        self._guard: contextlib.AbstractContextManager = guard if guard is not None else contextlib.nullcontext()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._outbox: collections.deque[SlotOutput] = collections.deque(maxlen=outbox_frames)

    def _next_output(self) -> SlotOutput | None:
        """The oldest output not read yet (under the guard); None when there is none."""
        return self._outbox.popleft() if self._outbox else None

    async def wait_live(self, timeout: float | None = None) -> None:
        if not await self._until(lambda: not self.state.waiting, _deadline(timeout)):
            raise TimeoutError
        if self.state == CallState.ENDED:
            raise CallEnded(self.end_reason or "ended")

    async def next_output(self, timeout: float) -> SlotOutput | None:
        out: SlotOutput | None = None

        def ready() -> bool:
            nonlocal out
            out = self._next_output()
            return out is not None or self.state == CallState.ENDED

        await self._until(ready, _deadline(timeout))
        if out is None and self.state == CallState.ENDED:
            raise CallEnded(self.end_reason or "ended")
        return out

    async def _until(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until `ready()` holds (looked at under the guard at each wake-up); False at `deadline`."""
        loop = asyncio.get_running_loop()
        while True:
            with self._guard:
                if ready():
                    return True
                if deadline is not None and loop.time() >= deadline:
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            try:
                await asyncio.wait_for(fut, None if deadline is None else max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass  # one more look: the news may have come just now
            finally:
                with self._guard:
                    self._waiters = [(lp, f) for lp, f in self._waiters if f is not fut]

    def _wake(self) -> None:
        """Wake every waiter (each looks again under the guard). Safe from any thread."""
        waiters, self._waiters = self._waiters, []
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, fut in waiters:
            if loop is running:
                _resolve(fut)
                continue
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass  # that event loop is closed; nobody is waiting any more


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else asyncio.get_running_loop().time() + timeout
