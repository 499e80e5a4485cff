"""The room's one queue for the media workers' callers (docs/processes.md, "One room, one queue"). In the
main process `QueueDesk`, on the router's loop, keeps each caller in the router's queue as a `DeskEntry`, in
order of arrival among every other caller; in a worker `DeskRoom`, on the worker's loop, is the doors' `Room`:
its own links to the engines for the frames, and the desk for every decision of who is seated where.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable

from ..call_settings import SamplingParams
from ..errors import CallerError
from ..serving.headroom import WaitReason
from ..serving.metrics import PoolMetrics
from ..serving.room import CallState, EndReason, PoolClosedError, PoolFullError
from . import messages as msg
from .engine_link import START_TIMEOUT, WORKER_LOST, EngineLink, Refusable, refusal, refused
from .pool_router import EngineSet, PoolRouter, UnreachableEngine
from .routed_call import RoutedCall

log = logging.getLogger(__name__)

# A worker's time to start a granted call on its engine and say so: longer than its own wait for
# the engine (START_TIMEOUT), so that a slow engine's refusal comes back as an answer.
GRANT_TIMEOUT = START_TIMEOUT + 5.0


class DeskEntry(RoutedCall):
    """A media worker's caller in the router's queue. Seating it is the worker's part (`Grant`)."""

    def __init__(self, desk: QueueDesk, worker: int, admit: msg.Start) -> None:
        super().__init__(admit.voice, admit.persona, SamplingParams(**admit.sampling), admit.door)
        self.desk, self.worker, self.rid = desk, worker, admit.rid
        self.placed = False  # seated on an engine by its worker: the room's queue is done with it

    @property
    def state(self) -> CallState:
        return CallState.PREFILL if self.placed else super().state

    async def take(self, engine: EngineLink, index: int) -> bool:
        if self.state == CallState.ENDED:
            return True  # it left meanwhile: nothing to seat
        outcome = await self.desk.grant(self, index)
        if outcome.outcome == "caller":
            raise CallerError(outcome.message)
        if outcome.outcome == "seated":
            self.placed = True
        elif outcome.outcome == "gone":
            self.end(EndReason.HANGUP)
        return outcome.outcome != "busy"

    def moved(self, position: int, reason: WaitReason) -> bool:
        if not super().moved(position, reason):
            return False
        self.desk.send(self.worker, msg.StateChange(rid=self.rid, state=CallState.QUEUED.value,
                                                    queue_position=position, wait_reason=str(reason)))
        return True

    def end(self, reason: str) -> None:
        if self._ended is None and not self.placed:
            super().end(reason)
            self.desk.ended(self)


class QueueDesk:
    """The media workers' callers in `router`'s queue; `send(worker, message)` reaches a worker."""

    def __init__(self, router: PoolRouter, send: Callable[[int, msg.WorkerCommand], None]) -> None:
        self.router = router
        self.send = send
        self._entries: dict[tuple[int, int], DeskEntry] = {}  # (worker, rid) -> its caller, until seated or ended
        self._grants: dict[tuple[int, int], asyncio.Future[msg.Placed]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._gone: set[int] = set()  # workers that stopped: nobody answers for their callers

    def receive(self, worker: int, message: msg.Start | msg.Placed | msg.Release) -> None:
        key = (worker, message.rid)
        match message:
            case msg.Start() if worker not in self._gone:
                task = asyncio.get_running_loop().create_task(self._admit(worker, message))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            case msg.Placed():
                fut = self._grants.pop(key, None)
                if fut is not None and not fut.done():
                    fut.set_result(message)
            case msg.Release(reason=reason):
                if (entry := self._entries.get(key)) is not None:
                    entry.release(reason)

    async def _admit(self, worker: int, admit: msg.Start) -> None:
        entry = DeskEntry(self, worker, admit)
        self._entries[(worker, admit.rid)] = entry
        try:
            await self.router.enter(entry)
        except (CallerError, PoolFullError, PoolClosedError) as exc:
            self._refuse(entry, exc)
        except Exception as exc:  # a bug here must not leave the worker's caller without an answer
            log.exception("media worker %d: placing call %s failed", worker, entry.id)
            entry.end(EndReason.error(type(exc).__name__))
            self._refuse(entry, PoolClosedError(f"the room failed to place the call ({type(exc).__name__})"))
        else:
            if entry.state != CallState.QUEUED:
                self._entries.pop((worker, admit.rid), None)

    def _refuse(self, entry: DeskEntry, exc: Refusable) -> None:
        self._entries.pop((entry.worker, entry.rid), None)
        self.send(entry.worker, refused(entry.rid, exc))

    async def grant(self, entry: DeskEntry, engine: int) -> msg.Placed:
        key = (entry.worker, entry.rid)
        if entry.worker in self._gone:
            return msg.Placed(entry.rid, "gone")
        fut: asyncio.Future[msg.Placed] = asyncio.get_running_loop().create_future()
        self._grants[key] = fut
        self.send(entry.worker, msg.Grant(entry.rid, engine))
        try:
            placed = await asyncio.wait_for(fut, GRANT_TIMEOUT)
        except TimeoutError:  # the worker (or its engine) is slow: the caller keeps its place
            log.warning("media worker %d: no answer to a seat for call %s within %.0f s", *key, GRANT_TIMEOUT)
            placed = msg.Placed(entry.rid, "busy")
        finally:
            self._grants.pop(key, None)
        if placed.outcome in ("seated", "gone", "caller"):
            self._entries.pop(key, None)
        return placed

    def ended(self, entry: DeskEntry) -> None:
        """The room ended a waiting caller: the worker is told unless the caller itself left."""
        if self._entries.pop((entry.worker, entry.rid), None) is not None and entry.end_reason != EndReason.HANGUP:
            ended = msg.StateChange(rid=entry.rid, state=CallState.ENDED.value, end_reason=entry.end_reason)
            self.send(entry.worker, ended)

    def worker_gone(self, worker: int) -> None:
        """A worker stopped: its callers leave the queue, and a pending seat finds nobody."""
        self._gone.add(worker)
        for (w, rid), fut in list(self._grants.items()):
            if w == worker and not fut.done():
                fut.set_result(msg.Placed(rid, "gone"))
        for (w, _), entry in list(self._entries.items()):
            if w == worker:
                entry.end(WORKER_LOST)


class DeskRoom(EngineSet):
    """The room as a media worker's doors see it; `send` reaches the main process's desk."""

    def __init__(self, engines: list[EngineLink | UnreachableEngine],
                 send: Callable[[msg.WorkerReport], None]) -> None:
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
