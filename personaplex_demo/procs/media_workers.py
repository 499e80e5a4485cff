"""The main process's side of the media workers: spawn them, place calls, forward the page.

With `--media-workers N` the page, its Gradio events and fastrtc's `WebRTC` component stay on
the one public port of the main process, but nothing of a call's media does. `MediaWorkers`:

- spawns N `media_worker` processes (`launcher.Child`: no torch in them) and restarts one that
  dies;
- takes over the component's `offer` server function (and the trickled ICE candidates that
  come through it) and its `set_input` (the page's `tick` event), and forwards each to the
  worker that owns the call; a new call goes to the worker with the fewest calls;
- mirrors each worker's page updates and closed connections into the component's own tables
  (`additional_outputs`, `connections`, the handler's `final_updates`), which the page's relay reads;
- asks the workers for a finished call's recording (`RemoteRecordings`, for the Stop button).

A worker that dies takes only its own calls with it: their pages are told, and the engines free
their slots when the worker's connections drop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from fastrtc import AdditionalOutputs

from ..rtc.patches import route_offers
from ..web.recording import RecordingFiles, recordings_prefix
from . import messages as msg
from .launcher import Child, stop_children
from .media_worker import WorkerSpec, run_worker
from .pool_router import PoolRouter
from .queue_desk import QueueDesk

log = logging.getLogger(__name__)

OFFER_TIMEOUT = 30.0
STOP_SECONDS = 5.0  # a worker's time to close its peers and exit after Stop, before it is terminated
MAX_RESTARTS, RESTART_WINDOW = 5, 60.0  # a worker that dies more often than this stays down
WORKER_LOST = ("Call ended: the server's media process for this call stopped. Please press Record to "
               "call again.")


def _failed(error: str, **meta: Any) -> JSONResponse:
    """fastrtc's own shape for a refused offer (the page shows a toast for some of them)."""
    return JSONResponse(status_code=200, content={"status": "failed", "meta": {"error": error, **meta}})


class _Worker:
    """The main process's record of one worker process."""

    def __init__(self, index: int, generation: int, child: Child) -> None:
        self.index = index
        self.generation = generation
        self.child = child
        self.ready = threading.Event()
        self.gone = False
        self.pid: int | None = None  # as the worker reports it, once ready
        self.torch_imported: bool | None = None
        self.calls: set[str] = set()  # webrtc ids
        self.pending: dict[int, concurrent.futures.Future] = {}

    @property
    def usable(self) -> bool:
        return self.ready.is_set() and not self.gone


class RestartLimit:
    """A worker that dies is restarted, unless it died MAX_RESTARTS times within RESTART_WINDOW."""

    def __init__(self) -> None:
        self._deaths: dict[int, list[float]] = {}  # worker index -> when it was last restarted

    def allow(self, index: int) -> bool:
        now = time.monotonic()
        recent = [t for t in self._deaths.get(index, []) if now - t < RESTART_WINDOW]
        if len(recent) >= MAX_RESTARTS:
            log.error("media worker %d died %d times within %.0f s; not restarting it", index, len(recent) + 1,
                      RESTART_WINDOW)
            return False
        self._deaths[index] = [*recent, now]
        return True


class MediaWorkers:
    def __init__(self, count: int, spec: WorkerSpec, *, restart: bool = True) -> None:
        """`spec` is the template for every worker (its index and recordings folder are set here)."""
        if count < 1:
            raise ValueError("media workers: at least 1")
        self.count = count
        self.restart = restart
        # Named like this process's own recordings folder: a crashed app's is removed at the next start.
        self.root = Path(tempfile.mkdtemp(prefix=recordings_prefix()))
        self._spec = spec
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._generations = itertools.count(1)
        self._owner: dict[str, _Worker] = {}  # webrtc id -> worker (on the page's event loop)
        self._last_update: dict[str, tuple] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._restarts = RestartLimit()
        self.rtc = None
        self.recordings = RemoteRecordings(self)
        self.desk: QueueDesk | None = None  # the room's queue, for the workers' callers (several engines)

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
                                       f"{worker.child.exitcode}); see its log lines above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"media worker {worker.index} did not start within {timeout:.0f} s")
        log.info("%d media worker(s) ready: pids %s", self.count, ", ".join(str(w.pid) for w in self._workers))

    def _spawn(self, index: int) -> _Worker:
        generation = next(self._generations)
        spec = replace(self._spec, index=index,
                       recordings_dir=str(self.root / f"worker-{index}-{generation}"))
        worker = _Worker(index, generation, Child(f"media-worker-{index}", run_worker, spec, spec.log_level))
        worker.child.start(lambda batch: self._on_batch(worker, batch), lambda: self._on_gone(worker))
        return worker

    def relink(self, index: int, address: Any) -> None:
        """Engine `index` came back at `address`: every worker, and every later one, links to it."""
        engines = list(self._spec.engines)
        engines[index] = address
        self._spec = replace(self._spec, engines=tuple(engines))
        with self._lock:
            workers = [w for w in self._workers if not w.gone]
        for worker in workers:
            worker.child.send(msg.Relink(index, address))

    def serve_queue(self, router: PoolRouter) -> None:
        """The workers' callers wait in `router`'s queue, beside everyone else's (queue_desk.py)."""
        self.desk = QueueDesk(router, self._send_to)
        router.on_queued = lambda count: self._tell_all(msg.QueueLength(count))

    def _send_to(self, generation: int, message: msg.WorkerCommand) -> None:
        self._tell_all(message, generation)

    def _tell_all(self, message: msg.WorkerCommand, generation: int | None = None) -> None:
        with self._lock:
            workers = [w for w in self._workers if not w.gone and generation in (None, w.generation)]
        for worker in workers:
            worker.child.send(message)

    def status(self) -> list[dict[str, Any]]:
        """Per worker, for /api/status."""
        with self._lock:
            workers = list(self._workers)
        return [{"index": w.index, "pid": w.pid, "alive": w.usable, "calls": len(w.calls),
                 "torch_imported": w.torch_imported} for w in workers]

    def close(self) -> None:
        """Stop every worker (their calls end) and delete their recordings."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            workers = list(self._workers)
        stop_children([w.child for w in workers], STOP_SECONDS)
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- the page's component ------------------------------------------------------------------

    def attach(self, rtc) -> None:
        """Forward `rtc`'s offers and inputs to the workers (rtc/patches.py `route_offers`)."""
        self.rtc = rtc
        route_offers(rtc, self.offer, self.set_input)

    def _least_loaded(self) -> _Worker | None:
        with self._lock:
            usable = [w for w in self._workers if w.usable]
        return min(usable, key=lambda w: (len(w.calls), w.index), default=None)

    async def offer(self, body: dict[str, Any]):
        self._loop = asyncio.get_running_loop()
        webrtc_id = str(body.get("webrtc_id"))
        if body.get("type") == "ice-candidate":
            worker = self._owner.get(webrtc_id)
            if worker is None:
                return _failed("unknown_connection")
            return await self._forward_offer(worker, body)
        if webrtc_id in self._owner:
            return _failed("connection_already_exists")
        limit = self.rtc.concurrency_limit
        if len(self._owner) >= limit:
            return _failed("concurrency_limit_reached", limit=limit)
        worker = self._least_loaded()
        if worker is None:
            return _failed("no media worker is running; try again in a few seconds")
        self._own(webrtc_id, worker)
        response = await self._forward_offer(worker, body)
        if isinstance(response, JSONResponse):  # refused: nothing to mirror
            self._disown(webrtc_id)
        return response

    async def _forward_offer(self, worker: _Worker, body: dict[str, Any]):
        try:
            answer: msg.OfferAnswer = await self._request(worker, lambda rid: msg.Offer(rid, body), OFFER_TIMEOUT)
        except Exception as exc:
            return _failed(f"media worker {worker.index}: {exc}")
        if answer.status_code is not None:
            return JSONResponse(status_code=answer.status_code, content=answer.json)
        return answer.json

    def set_input(self, webrtc_id: str, *args) -> None:
        worker = self._owner.get(webrtc_id)
        if worker is not None:
            # The first argument is the component's value (a WebRTCData or the id): plain data only.
            plain = [getattr(a, "webrtc_id", a) for a in args]
            worker.child.send(msg.Input(webrtc_id, plain))

    def _own(self, webrtc_id: str, worker: _Worker) -> None:
        self._owner[webrtc_id] = worker
        worker.calls.add(webrtc_id)
        # The page's relay may start before the first update arrives: give it a queue to wait on.
        self.rtc.connections[webrtc_id] = [worker]
        _ = self.rtc.additional_outputs[webrtc_id]

    def _disown(self, webrtc_id: str) -> None:
        worker = self._owner.pop(webrtc_id, None)
        if worker is not None:
            worker.calls.discard(webrtc_id)
        self._last_update.pop(webrtc_id, None)
        self.rtc.connections.pop(webrtc_id, None)
        outputs = self.rtc.additional_outputs.pop(webrtc_id, None)
        if outputs is not None:
            outputs.quit.set()

    # ---- messages from the workers -------------------------------------------------------------

    async def _request(self, worker: _Worker, ask: Callable[[int], msg.WorkerCommand], timeout: float) -> Any:
        """Send `ask(rid)` to `worker` and wait for its `Reply` (the reply's value)."""
        rid = next(self._rids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        worker.pending[rid] = fut
        if worker.gone:
            worker.pending.pop(rid, None)
            raise ConnectionError("the worker has stopped")
        worker.child.send(ask(rid))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        finally:
            worker.pending.pop(rid, None)

    def _on_batch(self, worker: _Worker, batch: list[msg.WorkerReport]) -> None:
        """A worker's reader thread: replies and readiness here, page updates to the page's loop."""
        page: list[msg.Outputs | msg.Closed] = []
        desk: list[msg.Admit | msg.Placed | msg.Leave | msg.Heard] = []
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
                case msg.Outputs() | msg.Closed():
                    page.append(message)
                case msg.Admit() | msg.Placed() | msg.Leave() | msg.Heard():
                    desk.append(message)
                case _:
                    log.warning("media worker %d: unexpected %s ignored", worker.index, type(message).__name__)
        if page and self._loop is not None and not self._loop.is_closed():  # closed: the page has stopped
            self._loop.call_soon_threadsafe(self._mirror, page)
        if desk and self.desk is not None:
            self.desk.from_thread(self._loop, worker.generation, desk)

    def _mirror(self, messages: list[msg.Outputs | msg.Closed]) -> None:
        """On the page's loop: a worker's page updates and closed connections."""
        for message in messages:
            if message.webrtc_id not in self._owner:
                continue
            match message:
                case msg.Outputs(webrtc_id=webrtc_id, args=args):
                    self._last_update[webrtc_id] = args
                    self.rtc.additional_outputs[webrtc_id].queue.put_nowait(AdditionalOutputs(*args))
                case msg.Closed(webrtc_id=webrtc_id, final=final):
                    if final is not None:
                        self.rtc.event_handler.final_updates.put(webrtc_id, final)
                    self._disown(webrtc_id)

    def _on_gone(self, worker: _Worker) -> None:
        """A worker's channel closed: it stopped (or we are closing)."""
        worker.gone = True
        for fut in list(worker.pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionError(f"media worker {worker.index} stopped"))
        if self._closing:
            return
        worker.child.join(2.0)
        if worker.child.alive:  # its channel broke but it lingers: it must not serve half a call
            worker.child.kill()
        log.error("media worker %d (pid %s) stopped (exit code %s); ending its %d call(s)", worker.index,
                  worker.pid, worker.child.exitcode, len(worker.calls))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._end_calls_of, worker)
        if not (self.restart and worker.ready.is_set() and self._restarts.allow(worker.index)):
            return  # it never worked, or it keeps dying: its share stays off
        replacement = self._spawn(worker.index)
        with self._lock:
            self._workers = [replacement if w is worker else w for w in self._workers]
        log.info("media worker %d: starting a replacement", worker.index)

    def _end_calls_of(self, worker: _Worker) -> None:
        if self.desk is not None:  # its callers in the room's queue leave it
            self.desk.worker_gone(worker.generation)
        for webrtc_id in list(worker.calls):
            last = self._last_update.get(webrtc_id)
            transcript, call_id = (last[0], last[2]) if last else ("", "")
            self.rtc.event_handler.final_updates.put(webrtc_id, (transcript, WORKER_LOST, call_id, None))
            self._disown(webrtc_id)


class RemoteRecordings:
    """The workers' recordings, as the page's Stop button looks them up (`RecordingStore`'s
    `get(call_id).wait_finished(timeout)`)."""

    max_age_seconds = 3600.0  # each worker's RecordingStore keeps its default

    def __init__(self, workers: MediaWorkers) -> None:
        self.workers = workers

    def get(self, call_id: str) -> RemoteRecording | None:
        return RemoteRecording(self.workers, call_id) if call_id else None

    def close(self) -> None:
        """Each worker deletes its own recordings; `MediaWorkers.close` the folder they share."""


class RemoteRecording:
    def __init__(self, workers: MediaWorkers, call_id: str) -> None:
        self.workers = workers
        self.call_id = call_id

    async def wait_finished(self, timeout: float) -> RecordingFiles | None:
        with self.workers._lock:
            workers = [w for w in self.workers._workers if w.usable]
        asks = [self.workers._request(w, lambda rid: msg.RecordingQuery(rid, self.call_id, timeout), timeout + 2.0)
                for w in workers]
        for found in await asyncio.gather(*asks, return_exceptions=True):
            if isinstance(found, msg.RecordingPaths):
                return RecordingFiles(Path(found.wav), Path(found.transcript))
        return None
