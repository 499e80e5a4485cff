"""The main process's side of the media workers (`--media-workers N`): spawn them, restart one that dies
(it takes only its own calls with it), route their messages to the page (page_relay.py), the queue
(queue_desk.py) and the API sockets handed to them (`HandedSockets`), and find a finished call's recording."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..procs import messages as msg
from ..procs import socket_handoff
from ..procs.launcher import Child, stop_children
from ..procs.pool_router import PoolRouter
from ..procs.queue_desk import QueueDesk
from ..web.recording import RecordingFiles, RecordingStore, recordings_prefix
from .media_worker import WorkerSpec, run_worker
from .page_relay import PageRelay

log = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # a worker's time to close its peers and exit after Stop, before it is killed
MAX_RESTARTS, RESTART_WINDOW = 5, 60.0  # a worker that dies more often than this stays down


@dataclass(eq=False)
class _Worker:
    """The main process's record of one worker process."""

    index: int
    generation: int
    child: Child
    ready: threading.Event = field(default_factory=threading.Event)
    gone: bool = False
    pid: int | None = None  # as the worker reports it, once ready
    torch_imported: bool | None = None
    calls: set[str] = field(default_factory=set)  # webrtc ids
    # The API sockets handed to it: number -> (kind, address).
    sockets: dict[int, tuple[str, str]] = field(default_factory=dict)
    pending: dict[int, concurrent.futures.Future] = field(default_factory=dict)
    handoff: socket.socket | None = None  # where API sockets' connections are handed to it

    @property
    def usable(self) -> bool:
        return self.ready.is_set() and not self.gone


class MediaWorkers:
    def __init__(self, count: int, spec: WorkerSpec) -> None:
        """`spec` is the template for every worker (its index and recordings folder are set here)."""
        self.count = count
        # Named like this process's own recordings folder: a crashed app's is removed at the next start.
        self.root = Path(tempfile.mkdtemp(prefix=recordings_prefix()))
        self._spec = spec
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._generations = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None  # the web server's, once a call or socket came
        self._closing = False
        self._restarts: dict[int, list[float]] = {}  # worker index -> when it was restarted
        self.recordings = RemoteRecordings(self)
        self.desk: QueueDesk | None = None  # the room's queue, for the workers' callers (several engines)
        self.page = PageRelay(self)  # the page's WebRTC component, its calls in the workers
        self.sockets = HandedSockets(self)  # the API sockets the workers serve

    # ---- processes -----------------------------------------------------------------------------

    def start(self) -> MediaWorkers:
        """Spawn the workers (they connect to the engines on their own; see `wait_ready`)."""
        self._workers = [self._spawn(i) for i in range(self.count)]
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            while not worker.ready.wait(0.2):
                if worker.gone:
                    raise RuntimeError(f"media worker {worker.index} exited while starting (exit code "
                                       f"{worker.child.process.exitcode}); see its log lines above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"media worker {worker.index} did not start within {timeout:.0f} s")
        log.info("%d media worker(s) ready: pids %s", self.count, ", ".join(str(w.pid) for w in self._workers))

    def _spawn(self, index: int) -> _Worker:
        generation = next(self._generations)
        # The API sockets' connections come over it (socket_handoff.py), one message each.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if self._spec.api else (None, None)
        spec = replace(self._spec, index=index, handoff=theirs,
                       recordings_dir=str(self.root / f"worker-{index}-{generation}"))
        worker = _Worker(index, generation, Child(f"media-worker-{index}", run_worker, spec, spec.log_level))
        try:
            worker.child.start(lambda batch: self._on_batch(worker, batch), lambda: self._on_gone(worker))
        finally:
            if theirs is not None:
                theirs.close()  # the worker has its own copy
        if ours is not None:
            ours.setblocking(False)
            worker.handoff = ours
        return worker

    def relink(self, index: int, address: Any) -> None:
        """Engine `index` came back at `address`: every worker, and every later one, links to it."""
        engines = list(self._spec.engines)
        engines[index] = address
        self._spec = replace(self._spec, engines=tuple(engines))
        self._tell(None, msg.Relink(index, address))

    def serve_queue(self, router: PoolRouter) -> None:
        """The workers' callers wait in `router`'s queue, beside everyone else's (queue_desk.py)."""
        self.desk = QueueDesk(router, self._tell)
        router.on_queued = lambda count: self._tell(None, msg.QueueLength(count))

    def _tell(self, generation: int | None, message: msg.WorkerCommand) -> None:
        """`message` to the worker of `generation`, or to every running one."""
        for worker in self.workers(lambda w: not w.gone and generation in (None, w.generation)):
            worker.child.send(message)

    def workers(self, keep: Callable[[_Worker], bool] = lambda w: True) -> list[_Worker]:
        with self._lock:
            return [w for w in self._workers if keep(w)]

    def status(self) -> list[dict[str, Any]]:
        """Per worker, for /api/status."""
        return [{"index": w.index, "pid": w.pid, "alive": w.usable, "calls": len(w.calls),
                 "api_sockets": len(w.sockets), "torch_imported": w.torch_imported} for w in self.workers()]

    def on_loop(self) -> None:
        """Called on the web server's loop by whatever first reaches the workers through it (an
        offer, a socket): their reports are handed to that loop."""
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        """Stop every worker (their calls end) and delete their recordings."""
        if self._closing:
            return
        self._closing = True
        stop_children([w.child for w in self.workers()], STOP_SECONDS)
        shutil.rmtree(self.root, ignore_errors=True)

    def least_loaded(self, able: Callable[[_Worker], bool] = lambda w: True) -> _Worker | None:
        return min(self.workers(lambda w: w.usable and able(w)), key=lambda w: (len(w.calls) + len(w.sockets), w.index),
                   default=None)

    # ---- messages from the workers -------------------------------------------------------------

    async def request(self, worker: _Worker, ask: Callable[[int], msg.WorkerCommand], timeout: float) -> Any:
        """Send `ask(rid)` to `worker` and wait for its `Reply` (the reply's value)."""
        rid = next(self._rids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        worker.pending[rid] = fut
        try:
            if worker.gone:
                raise ConnectionError("the worker has stopped")
            worker.child.send(ask(rid))
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        finally:
            worker.pending.pop(rid, None)

    def _on_batch(self, worker: _Worker, batch: list[msg.WorkerReport]) -> None:
        """A worker's reader thread: replies and readiness here, the rest on the web server's loop."""
        rest = []
        for message in batch:
            match message:
                case msg.Reply(rid=rid, value=value):
                    fut = worker.pending.get(rid)
                    if fut is not None and not fut.done():
                        fut.set_result(value)
                case msg.WorkerReady(pid=pid, torch_imported=torch_imported):
                    worker.pid, worker.torch_imported = pid, torch_imported
                    if torch_imported:
                        log.warning("media worker %d imported torch: it should not need it", worker.index)
                    worker.ready.set()
                case _:
                    rest.append(message)
        # The rest concerns calls and sockets that came through that loop (`on_loop`); closed: the page has stopped.
        if rest and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._receive, worker, rest)

    def _receive(self, worker: _Worker, messages: list[msg.WorkerReport]) -> None:
        for message in messages:
            match message:
                case msg.Outputs() | msg.Closed():
                    self.page.mirror(message)
                case msg.Start() | msg.Placed() | msg.Release() if self.desk is not None:
                    self.desk.receive(worker.generation, message)
                case msg.SocketError() | msg.SocketClosed():
                    self.sockets.receive(worker, message)
                case _:
                    log.warning("media worker %d: unexpected %s ignored", worker.index, type(message).__name__)

    def _on_gone(self, worker: _Worker) -> None:
        """A worker's channel closed: it stopped (or we are closing)."""
        worker.gone = True
        for fut in list(worker.pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionError(f"media worker {worker.index} stopped"))
        if self._closing:
            return
        worker.child.process.join(2.0)
        if worker.child.alive:  # its channel broke but it lingers: it must not serve half a call
            worker.child.kill()
        log.error("media worker %d (pid %s) stopped (exit code %s); ending its %d call(s)", worker.index,
                  worker.pid, worker.child.process.exitcode, len(worker.calls))
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._end_calls_of, worker)
        if not (worker.ready.is_set() and self._may_restart(worker.index)):
            return  # it never worked, or it keeps dying: its share stays off
        replacement = self._spawn(worker.index)
        with self._lock:
            self._workers = [replacement if w is worker else w for w in self._workers]
        log.info("media worker %d: starting a replacement", worker.index)

    def _may_restart(self, index: int) -> bool:
        """Unless it died MAX_RESTARTS times within RESTART_WINDOW."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(index, []) if now - t < RESTART_WINDOW]
        if len(recent) >= MAX_RESTARTS:
            log.error("media worker %d died %d times within %.0f s; not restarting it", index, len(recent) + 1,
                      RESTART_WINDOW)
            return False
        self._restarts[index] = [*recent, now]
        return True

    def _end_calls_of(self, worker: _Worker) -> None:
        if self.desk is not None:  # its callers in the room's queue leave it
            self.desk.worker_gone(worker.generation)
        self.sockets.worker_gone(worker)
        self.page.worker_gone(worker)


class HandedSockets:
    """The API sockets handed to the workers (socket_handoff.py), each in its worker's `sockets` until it
    closes or the worker stops. The workers' error events come back here, so the door's figures count
    every socket wherever it runs."""

    def __init__(self, workers: MediaWorkers) -> None:
        self.workers = workers
        self._numbers = itertools.count(1)
        self._door = None  # api/doors.py ApiDoors
        self._web_server: Callable[[], Any] = lambda: None

    def serve(self, door, web_server: Callable[[], Any]) -> None:
        """Hand `door`'s admitted sockets over; `web_server()` is the public server whose
        connections they are (uvicorn's, as Gradio runs it)."""
        socket_handoff.check_uvicorn()
        self._door, self._web_server = door, web_server
        door.hand_off = self.hand_off

    async def hand_off(self, ws, kind: str, address: str) -> bool:
        """Pass an admitted socket's connection to a worker; False (serve it here) when none can take it."""
        self.workers.on_loop()
        protocol = socket_handoff.connection_of(self._web_server(), ws.scope)
        worker = self.workers.least_loaded(lambda w: w.handoff is not None)
        if protocol is None or worker is None:
            log.warning("an API socket is served by the main process: %s", "no media worker can take it"
                        if worker is None else "its connection was not found in the web server")
            return False
        number = next(self._numbers)
        try:
            socket_handoff.hand_over(protocol, worker.handoff, socket_handoff.request_bytes(ws.scope),
                                     {"id": number, "kind": kind})
        except OSError as exc:
            log.warning("media worker %d could not take an API socket (%s); serving it here", worker.index, exc)
            return False
        worker.sockets[number] = (kind, address)
        return True

    def receive(self, worker: _Worker, report: msg.SocketError | msg.SocketClosed) -> None:
        """`worker`'s word on a socket it serves: an error event it sent (for the door's counts), or
        its close."""
        match report:
            case msg.SocketError(kind=kind, code=code) if self._door is not None:
                self._door.doors[kind].stats.error(code)
            case msg.SocketClosed(handoff=number):
                self._closed(worker, number)

    def worker_gone(self, worker: _Worker) -> None:
        """On the sockets' loop: `worker` stopped, and its sockets' connections with it."""
        if worker.handoff is not None:
            worker.handoff.close()
        for number in list(worker.sockets):
            self._closed(worker, number)

    def _closed(self, worker: _Worker, number: int) -> None:
        handed = worker.sockets.pop(number, None)
        if handed is not None and self._door is not None:
            self._door.handed_closed(*handed)


@dataclass(frozen=True)
class RemoteRecordings:
    """The workers' recordings, as the page's Stop button looks them up (as in a `RecordingStore`)."""

    media: MediaWorkers
    max_age_seconds = RecordingStore.max_age_seconds  # each worker's store keeps its default

    def get(self, call_id: str) -> RemoteRecording | None:
        return RemoteRecording(self.media, call_id) if call_id else None

    def close(self) -> None:
        """Each worker deletes its own recordings; `MediaWorkers.close` the folder they share."""


@dataclass(frozen=True)
class RemoteRecording:
    media: MediaWorkers
    call_id: str

    async def wait_finished(self, timeout: float) -> RecordingFiles | None:
        asks = [self.media.request(w, lambda rid: msg.RecordingQuery(rid, self.call_id, timeout), timeout + 2.0)
                for w in self.media.workers(lambda w: w.usable)]
        for found in await asyncio.gather(*asks, return_exceptions=True):
            if isinstance(found, tuple):  # its (wav, transcript) paths
                return RecordingFiles(*map(Path, found))
        return None
