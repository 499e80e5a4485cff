"""A media worker process: the WebRTC peers of some callers and their CallHandlers, no torch. Its answer to
an offer carries its own ICE candidates, so the browser's media comes straight here; the handlers reach the
engines through a `DeskRoom` (docs/processes.md § How they talk)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from fastapi.responses import JSONResponse
from fastrtc import AdditionalOutputs
from fastrtc.webrtc_connection_mixin import WebRTCConnectionMixin
from starlette.applications import Starlette

from ..api.config import ApiConfig
from ..api.doors import KINDS, ApiDoors
from ..api.socket_base import DoorStats
from ..procs import messages as msg
from ..procs.channel import Address, Channel
from ..procs.engine_link import EngineLink, SilenceWatchdog
from ..procs.pool_router import UnreachableEngine
from ..procs.queue_desk import DeskRoom
from ..procs.socket_handoff import WorkerSockets
from ..rtc.ice import server_configuration
from ..rtc.patches import answer_offers, apply_media_settings
from ..runtime.facts import EngineFacts
from ..web.handler import CallHandler
from ..web.recording import RecordingStore

log = logging.getLogger(__name__)

UNLIMITED = 1 << 30  # the main process enforces the page's concurrency limit across workers
RELINK_SECONDS = 2.0  # a lost engine on another machine is tried again this often
CALLS_END_SECONDS = 2.0  # at a stop, the longest wait for the sockets whose calls the room ended
CONNECT_SECONDS = 600.0  # for the engines to answer: they may still be loading their model


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    engines: tuple[Address, ...]  # each engine's PoolServer: an AF_UNIX path, or TCP for a Ray engine
    authkey: bytes
    recordings_dir: str
    server_rtc_configuration: dict[str, Any] | None = None
    log_level: int = logging.INFO
    api: ApiConfig | None = None  # the API door's settings, when this worker serves its sockets
    handoff: socket.socket | None = None  # where their connections arrive (socket_handoff.py)

    @property
    def watch_silence(self) -> bool:
        """Engines on other machines (a TCP address) may go silent or away: give up on one gone silent
        (`SilenceWatchdog`), link to it again when it answers."""
        return any(not isinstance(a, str) for a in self.engines)


class ReportedStats(DoorStats):
    """A door's counts in a worker: its error events also go to the main process's door, which
    counts the sockets themselves (open, refused) at the door."""

    def __init__(self, kind: str, send: Callable[[msg.WorkerReport], None]) -> None:
        super().__init__()
        self.kind, self._send = kind, send

    def error(self, code: str) -> None:
        super().error(code)
        self._send(msg.SocketError(self.kind, code))


class MediaHost(WebRTCConnectionMixin):
    """fastrtc's connection handling (the same code the page's WebRTC component runs), without a
    page: offers come from the main process and page updates go back to it."""

    def __init__(self, handler: CallHandler, server_rtc_configuration: dict[str, Any] | None,
                 send: Callable[[msg.WorkerReport], None]) -> None:
        super().__init__()
        self.event_handler = handler
        handler.peers = self.pcs.get  # for each call's packet counts
        self.modality = "audio"
        self.mode = "send-receive"
        self.concurrency_limit = UNLIMITED
        self.time_limit = None
        self.allow_extra_tracks = False
        self.rtc_configuration = None
        self.server_rtc_configuration = server_configuration(server_rtc_configuration)  # relay-only kept
        self._send = send
        answer_offers(self)  # as the page's component does: 40 ms packets, every browser's ICE candidates

    def outputs_to_main(self, webrtc_id: str) -> Callable[[AdditionalOutputs], None]:
        return lambda outputs: self._send(msg.Outputs(webrtc_id, tuple(outputs.args)))

    def clean_up(self, webrtc_id: str):
        known = webrtc_id in self.handlers or webrtc_id in self.pcs or webrtc_id in self.connections
        connection = super().clean_up(webrtc_id)
        if known:
            self._send(msg.Closed(webrtc_id, self.event_handler.final_updates.pop(webrtc_id)))
        return connection


def _connect(spec: WorkerSpec) -> list[EngineLink | UnreachableEngine]:
    """Connect to every engine, waiting while they load their model. Engines on other machines
    (`watch_silence`) had loaded before any worker started: once one answers, one that does not (its
    machine may be gone) is linked to later if it comes back (`WorkerLoop.keep_linked`)."""
    engines: list[EngineLink | UnreachableEngine] = [UnreachableEngine(a, f"engine-{i}")
                                                     for i, a in enumerate(spec.engines)]
    # Which errors mean "not listening yet": on this machine, only a socket that is not there or refuses.
    retry = Exception if spec.watch_silence else (FileNotFoundError, ConnectionRefusedError)
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        for index, address in enumerate(spec.engines):
            if engines[index].alive:
                continue
            try:
                engines[index] = EngineLink(address, spec.authkey)
            except retry as exc:  # refused, unreachable, timed out
                if spec.watch_silence:
                    log.warning("media worker %d: engine %d at %s does not answer (%s); linking to it later",
                                spec.index, index, address, type(exc).__name__)
        alive = [e.alive for e in engines]
        if all(alive) or (spec.watch_silence and any(alive)):
            return engines
        if time.monotonic() > deadline:
            missing = ", ".join(str(e.address) for e in engines if not e.alive)
            raise RuntimeError(f"no engine at {missing} within {CONNECT_SECONDS:.0f} s")
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            raise SystemExit("the main process is gone")
        time.sleep(1.0 if spec.watch_silence else 0.2)


class WorkerLoop:
    """A media worker's event loop: its calls' handlers and peers, and the main process's
    commands, until `Stop` (or until the main process goes away). Made on that loop (`serve`)."""

    def __init__(self, spec: WorkerSpec, control: Connection, engines: list[EngineLink | UnreachableEngine]) -> None:
        self.spec = spec
        self.loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.recordings = RecordingStore(spec.recordings_dir)
        self.addresses = list(spec.engines)  # where each engine was last heard of
        self.watchdog = SilenceWatchdog() if spec.watch_silence else None
        for engine in engines if self.watchdog is not None else ():
            self.watchdog.watch(engine)
        self.channel = Channel(control, f"media-worker-{spec.index}", self.on_batch, self.on_close)
        self.room = DeskRoom(engines, self.channel.send)
        facts = next(e for e in engines if e.alive).facts
        self.host = MediaHost(CallHandler(self.room, self.recordings, model_name=facts.get("model_name")),
                              spec.server_rtc_configuration, self.channel.send)
        self.sockets: WorkerSockets | None = None
        self.api_door: ApiDoors | None = None
        if spec.api is not None and spec.handoff is not None:  # the API sockets the main process hands over
            config = replace(spec.api, model_name=facts.get("model_name", spec.api.model_name))
            self.api_door = door = ApiDoors(self.room, EngineFacts(facts), config,
                                            {kind: ReportedStats(kind, self.channel.send) for kind in KINDS})
            self.sockets = WorkerSockets(spec.handoff, Starlette(routes=door.served_routes()),
                                         lambda meta: self.channel.send(msg.SocketClosed(int(meta["id"]))))

    async def run(self) -> None:
        self.channel.start()
        self.channel.send(msg.WorkerReady(os.getpid(), "torch" in sys.modules))
        if self.watchdog is not None:  # engines on other machines may come back
            self.spawn(self.keep_linked())
        log.info("media worker %d ready (pid %d, engines: %s)", self.spec.index, os.getpid(),
                 ", ".join(e.name for e in self.room.engines))
        await self.stopped.wait()
        # The room ended every call before its workers are stopped, and the news may still be on its
        # way here: a socket that hears it closes with the room's reason, where closing it now says 1012.
        deadline = time.monotonic() + CALLS_END_SECONDS
        while self.api_door is not None and self.api_door.ending_calls() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for pc in list(self.host.pcs.values()):
            await pc.close()
        if self.sockets is not None:  # sockets whose calls the room ended have closed with its reason
            await self.sockets.close(2.0)
        await asyncio.sleep(0.1)  # let the handlers' shutdowns release their calls
        self.room.close()
        if self.watchdog is not None:
            self.watchdog.close()
        self.recordings.close()
        self.channel.close()

    # ---- the channel's reader thread -------------------------------------------------------------

    def on_batch(self, batch: list[msg.WorkerCommand]) -> None:
        self.loop.call_soon_threadsafe(self.dispatch, batch)

    def on_close(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already gone
            self.loop.call_soon_threadsafe(self.stopped.set)

    # ---- the loop --------------------------------------------------------------------------------

    def dispatch(self, batch: list[msg.WorkerCommand]) -> None:
        for message in batch:
            match message:
                case msg.Offer(rid=rid, body=body):
                    self.spawn(self.answer_offer(rid, body))
                case msg.Input(webrtc_id=webrtc_id, args=args):
                    self.host.set_input(webrtc_id, *args)
                case msg.RecordingQuery(rid=rid, call_id=call_id, timeout=timeout):
                    self.spawn(self.find_recording(rid, call_id, timeout))
                case msg.Relink(index=index, address=address):
                    self.addresses[index] = address
                    self.spawn(self.relink(index))
                case msg.Stop():
                    self.stopped.set()
                case msg.Grant() | msg.StateChange() | msg.Refused() | msg.QueueLength():
                    self.room.receive(message)
                case _:
                    log.warning("media worker %d: unexpected %s ignored", self.spec.index, type(message).__name__)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self.tasks.discard)

    async def answer_offer(self, rid: int, body: dict[str, Any]) -> None:
        try:
            result = await self.host.handle_offer(body, self.host.outputs_to_main(str(body.get("webrtc_id"))))
            # A refusal is a JSONResponse: it keeps its status code.
            answer = ((json.loads(bytes(result.body)), result.status_code) if isinstance(result, JSONResponse)
                      else (result, None))
        except Exception as exc:
            log.exception("media worker %d: the offer for %s failed", self.spec.index, body.get("webrtc_id"))
            answer = ({"status": "failed", "meta": {"error": f"{type(exc).__name__}: {exc}"}}, 200)
        self.channel.send(msg.Reply(rid, answer))

    async def keep_linked(self) -> None:
        """Engines on other machines: link again to one this worker lost (it went silent, or it
        restarted: `Relink` gives its new address), every RELINK_SECONDS."""
        while True:
            await asyncio.sleep(RELINK_SECONDS)
            for index, engine in enumerate(self.room.engines):
                if not engine.alive:
                    await self.relink(index)

    async def relink(self, index: int) -> None:
        address = self.addresses[index]
        try:
            engine = await asyncio.to_thread(EngineLink, address, self.spec.authkey)
        except Exception as exc:  # not back yet: the next round tries again
            log.debug("media worker %d: engine %d at %s not reachable: %s", self.spec.index, index, address, exc)
            return
        if self.room.engines[index].alive:  # linked meanwhile, or never lost here
            engine.close()
            return
        self.room.replace(self.room.engines[index], engine)
        log.info("media worker %d: linked to engine %d again at %s", self.spec.index, index, address)
        if self.watchdog is not None:
            self.watchdog.watch(engine)

    async def find_recording(self, rid: int, call_id: str, timeout: float) -> None:
        rec = self.recordings.get(call_id)
        files = await rec.wait_finished(timeout) if rec is not None else None
        paths = None if files is None else (str(files.wav), str(files.transcript))
        self.channel.send(msg.Reply(rid, paths))


async def serve(spec: WorkerSpec, control: Connection) -> None:
    engines = await asyncio.to_thread(_connect, spec)  # the engines may still be loading
    await WorkerLoop(spec, control, engines).run()


def run_worker(spec: WorkerSpec, control: Connection) -> None:
    """The worker process's entry point (after `launcher`'s preamble)."""
    apply_media_settings()
    asyncio.run(serve(spec, control))
