"""The main process's desk for the media workers' callers: each waits in the router's one queue as a
`DeskEntry`, in order of arrival among every other caller; the messages (Start, Grant, Placed, StateChange,
Release) are in docs/processes.md, "One room, one queue". Every method runs on the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..call_settings import SamplingParams
from ..errors import CallerError
from ..serving.headroom import WaitReason
from ..serving.room import CallState, EndReason, PoolClosedError, PoolFullError
from . import messages as msg
from .engine_link import START_TIMEOUT, WORKER_LOST, EngineLink, Refusable, refused
from .pool_router import PoolRouter
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
