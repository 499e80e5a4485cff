"""A media worker's `Room`: its own links to the engines for the frames, and the main process's one
queue (queue_desk.py) for every decision of who is seated where; the exchange of messages is in
docs/processes.md, "One room, one queue". Everything runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable

from ..errors import CallerError
from ..serving.headroom import WaitReason
from ..serving.metrics import PoolMetrics
from ..serving.room import CallState, EndReason, PoolClosedError
from . import messages as msg
from .engine_link import EngineLink, refusal
from .pool_router import EngineSet, UnreachableEngine
from .queue_desk import GRANT_TIMEOUT
from .routed_call import RoutedCall


class DeskRoom(EngineSet):
    """The room as a media worker's doors see it; `send` reaches the main process's desk."""

    def __init__(self, engines: list[EngineLink | UnreachableEngine], send: Callable[[msg.WorkerReport], None]) -> None:
        super().__init__(engines)
        self._send = send
        self._rids = itertools.count(1)
        self._calls: dict[int, RoutedCall] = {}  # waiting for a seat
        self._first: dict[int, asyncio.Future[None]] = {}  # acquire waits for the desk's first answer
        self._tasks: set[asyncio.Task] = set()
        self.queued_in_room = 0  # the main process's queue, every worker's and door's callers (QueueLength)

    def snapshot(self) -> PoolMetrics:
        metrics = self.engines_figures()
        return dataclasses.replace(metrics, queue_length=metrics.queue_length + self.queued_in_room)

    async def enter(self, call: RoutedCall) -> None:
        """A place for `call` in the main process's one queue, or a seat: once the desk first answers."""
        rid = next(self._rids)
        call.on_leave = lambda reason: self._leave(rid, reason)
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[rid], self._first[rid] = call, first
        self._send(msg.Start(rid, call.voice, call.persona, dataclasses.asdict(call.sampling), may_queue=True,
                             door=call.door))
        # The room may offer it a seat on each engine in turn before it answers.
        answer_within = GRANT_TIMEOUT * (len(self.engines) + 1)
        try:
            await asyncio.wait_for(first, answer_within)
        except TimeoutError:
            call.release(EndReason.error("no answer from the room"))
            raise PoolClosedError(f"the room did not answer within {answer_within:.0f} s") from None
        except BaseException:  # refused, or the door gave up (cancelled): it holds no place
            call.release(EndReason.HANGUP)
            raise
        finally:
            self._first.pop(rid, None)

    def _leave(self, rid: int, reason: str) -> None:
        if self._calls.pop(rid, None) is not None:
            self._send(msg.Release(rid, reason))

    # ---- the desk's messages (on the worker's loop) --------------------------------------------

    def receive(self, message: msg.Grant | msg.StateChange | msg.Refused | msg.QueueLength) -> None:
        if isinstance(message, msg.QueueLength):
            self.queued_in_room = message.count
            return
        call = self._calls.get(message.rid)
        match message:
            case msg.Grant(rid=rid, engine=index):
                task = asyncio.get_running_loop().create_task(self._take(rid, call, index))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            case msg.StateChange(rid=rid, state=CallState.ENDED, end_reason=reason) if call is not None:
                call.end(reason or "ended")  # its wait limit, no engine left
                self._calls.pop(rid, None)
                self._answered(rid)
            case msg.StateChange(rid=rid, queue_position=position, wait_reason=reason) if call is not None:
                call.moved(position, WaitReason(reason))
                self._answered(rid)
            case msg.Refused(rid=rid, kind=kind, message=text, cause=cause):
                self._calls.pop(rid, None)
                self._answered(rid, refusal(kind, text, cause))

    async def _take(self, rid: int, call: RoutedCall | None, index: int) -> None:
        """Start the call on the engine the desk offers (`Grant`), and say how it went (`Placed`)."""
        if call is None or call.state == CallState.ENDED or not 0 <= index < len(self.engines):
            self._calls.pop(rid, None)
            self._send(msg.Placed(rid, "gone"))
            return
        try:
            seated = await call.take(self.engines[index], index)
        except CallerError as exc:
            self._send(msg.Placed(rid, "caller", str(exc)))
            self._calls.pop(rid, None)
            call.end(EndReason.error(exc))
            self._answered(rid, exc)
            return
        if not seated:
            self._send(msg.Placed(rid, "busy"))
            return
        self._calls.pop(rid, None)
        self._send(msg.Placed(rid, "gone" if call.inner is None else "seated"))
        self._answered(rid)

    def _answered(self, rid: int, error: Exception | None = None) -> None:
        first = self._first.get(rid)
        if first is not None and not first.done():
            if error is None:
                first.set_result(None)
            else:
                first.set_exception(error)

    def close(self) -> None:
        for call in self._calls.values():
            call.end(EndReason.SHUTDOWN)
        self._calls.clear()
        self.close_links()

