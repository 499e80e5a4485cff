"""A media worker process: the WebRTC peers of some callers and their CallHandlers, no torch.

The main process (see `media_router`) keeps the page and the one public port; it hands each
call's offer to a worker, which answers it with its own ICE candidates, so the browser's media
goes straight to this process's UDP ports. Here run aiortc (Opus, SRTP, RTP), fastrtc's
resampling and the handlers, on this process's own event loop and its own share of the CPU. The
handlers reach the engine(s) through `engine_client.EngineRouter`: frames and outputs only.

Control messages with the main process (tuples over one `ipc.Channel`):

    main -> worker   ("offer", rid, body)            an offer or a trickled ICE candidate
                     ("input", webrtc_id, args)       the page's inputs (the `tick` event)
                     ("recording", rid, call_id, timeout)
                     ("stop",)
    worker -> main   ("ready", pid, torch imported?)
                     ("reply", rid, {"json": ..., "status_code": int | None})
                     ("outputs", webrtc_id, args)     a page update (AdditionalOutputs args)
                     ("closed", webrtc_id, final)     the connection closed; its last page update
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fastapi.responses import JSONResponse
from fastrtc import AdditionalOutputs
from fastrtc.webrtc_connection_mixin import WebRTCConnectionMixin

from ..rtc.audio import answering_with_packet_time
from ..rtc.ice import server_configuration
from ..rtc.settings import apply_media_settings
from ..runtime.hub import install_secret_filter
from ..web.handler import CallHandler, FinalUpdates
from ..web.recording import RecordingStore
from .channel import Channel
from .remote_pool import EngineRouter, RemoteEngine

log = logging.getLogger(__name__)

UNLIMITED = 1 << 30  # the main process enforces the page's concurrency limit across workers


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    engines: tuple[str, ...]  # the AF_UNIX address of each engine's EngineServer
    authkey: bytes
    recordings_dir: str
    max_wait_seconds: float | None = 600.0
    model_name: str | None = None
    server_rtc_configuration: dict[str, Any] | None = None
    loopback_ice: bool = False
    connect_timeout: float = 600.0  # the engines may still be loading their model
    log_level: int = logging.INFO


class MediaHost(WebRTCConnectionMixin):
    """fastrtc's connection handling (the same code the page's WebRTC component runs), without a
    page: offers come from the main process and page updates go back to it."""

    def __init__(self, handler: CallHandler, server_rtc_configuration: dict[str, Any] | None, send) -> None:
        super().__init__()
        self.event_handler = handler
        self.modality = "audio"
        self.mode = "send-receive"
        self.concurrency_limit = UNLIMITED
        self.time_limit = None
        self.allow_extra_tracks = False
        self.rtc_configuration = None
        self.server_rtc_configuration = server_configuration(server_rtc_configuration)  # relay-only kept
        self._send = send
        # As the page's component does: answers ask the browser for 40 ms packets (rtc/audio.py).
        self.handle_offer = answering_with_packet_time(self.handle_offer)

    def outputs_to_main(self, webrtc_id: str):
        def relay(outputs: AdditionalOutputs) -> None:
            self._send(("outputs", webrtc_id, tuple(outputs.args)))

        return relay

    def clean_up(self, webrtc_id: str):
        known = webrtc_id in self.handlers or webrtc_id in self.pcs or webrtc_id in self.connections
        connection = super().clean_up(webrtc_id)
        if known:
            self._send(("closed", webrtc_id, FinalUpdates.pop(webrtc_id)))
        return connection


def _reply(result: Any) -> dict[str, Any]:
    if isinstance(result, JSONResponse):
        return {"json": json.loads(bytes(result.body)), "status_code": result.status_code}
    return {"json": result, "status_code": None}


def _connect(spec: WorkerSpec) -> list[RemoteEngine]:
    """Connect to every engine, waiting while they load their model."""
    deadline = time.monotonic() + spec.connect_timeout
    engines = []
    for address in spec.engines:
        while True:
            try:
                engines.append(RemoteEngine(address, spec.authkey))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no engine at {address} within {spec.connect_timeout:.0f} s") from None
                parent = multiprocessing.parent_process()
                if parent is not None and not parent.is_alive():
                    raise SystemExit("the main process is gone") from None
                time.sleep(0.2)
    return engines


async def serve(spec: WorkerSpec, control: Connection) -> None:
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def dispatch(batch: list[tuple]) -> None:
        for message in batch:
            tag = message[0]
            if tag == "offer":
                spawn(answer_offer(*message[1:]))
            elif tag == "input":
                host.set_input(message[1], *message[2])
            elif tag == "recording":
                spawn(find_recording(*message[1:]))
            elif tag == "stop":
                stopped.set()

    def spawn(coro) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def answer_offer(rid: int, body: dict[str, Any]) -> None:
        try:
            result = await host.handle_offer(body, host.outputs_to_main(str(body.get("webrtc_id"))))
            reply = _reply(result)
        except Exception as exc:
            log.exception("media worker %d: the offer for %s failed", spec.index, body.get("webrtc_id"))
            reply = {"json": {"status": "failed", "meta": {"error": f"{type(exc).__name__}: {exc}"}},
                     "status_code": 200}
        channel.send(("reply", rid, reply))

    async def find_recording(rid: int, call_id: str, timeout: float) -> None:
        rec = recordings.get(call_id)
        files = await rec.wait_finished(timeout) if rec is not None else None
        channel.send(("reply", rid, None if files is None else (str(files.wav), str(files.transcript))))

    def on_batch(batch: list[tuple]) -> None:
        loop.call_soon_threadsafe(dispatch, batch)

    def on_close() -> None:
        try:
            loop.call_soon_threadsafe(stopped.set)
        except RuntimeError:
            pass  # the loop is already gone

    router = EngineRouter(await asyncio.to_thread(_connect, spec))
    recordings = RecordingStore(spec.recordings_dir)
    channel = Channel(control, f"media-worker-{spec.index}", on_batch, on_close)
    model_name = spec.model_name or router.engines[0].info.get("model_name")
    host = MediaHost(CallHandler(router, recordings, max_wait_seconds=spec.max_wait_seconds,
                                 model_name=model_name),
                     spec.server_rtc_configuration, channel.send)
    channel.start()
    channel.send(("ready", os.getpid(), "torch" in sys.modules))
    log.info("media worker %d ready (pid %d, engines: %s)", spec.index, os.getpid(),
             ", ".join(e.name for e in router.engines))
    await stopped.wait()
    for pc in list(host.pcs.values()):
        await pc.close()
    await asyncio.sleep(0.1)  # let the handlers' shutdowns release their calls
    router.close()
    recordings.close()
    channel.close()


def run_worker(spec: WorkerSpec, control: Connection) -> None:
    """The worker process's entry point (a spawned multiprocessing.Process)."""
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s media-worker-{spec.index} %(name)s: %(message)s")
    install_secret_filter()
    apply_media_settings(spec.loopback_ice)
    try:
        asyncio.run(serve(spec, control))
    except KeyboardInterrupt:
        pass
