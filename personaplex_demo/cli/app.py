"""PersonaPlex Live: serve the page (`personaplex-live`, or `python app.py` in the repository).
Every setting is a field of `AppConfig` (cli/config.py)."""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..logs import configure_logging
from ..model.config import LMConfig
from ..runtime.capacity import context_frames
from .config import CHATTY_LOGGERS, AppConfig, parse_config
from .lifecycle import StopSignals, exit_now, shut_down

if TYPE_CHECKING:
    from ..orchestration.topology import Topology
    from ..web.recording import RecordingStore

log = logging.getLogger(__name__)
PAGE_NICENESS = 10  # the web server's thread beside media workers and engine processes (page_second)


def setup_logging(verbose: bool = False) -> None:
    configure_logging(logging.INFO)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    sys.stdout = PrintsToLog(logging.INFO if verbose else logging.DEBUG)


class NotStarted(Exception):
    """The app cannot start or serve (the reason is logged); its argument is the exit status."""


def main(argv: list[str] | None = None) -> int:
    """Check, start, serve until a stop signal, then end every call with a message and exit."""
    cfg = parse_config(argv)
    setup_logging(cfg.verbose)
    try:
        rtc, server_rtc = preflight(cfg)
        topology = start_room(cfg, server_rtc)
        shut_down_app(*serve(cfg, topology, rtc, server_rtc), topology)
    except NotStarted as exc:
        return exc.args[0]
    exit_now(0)
    return 0


def preflight(cfg: AppConfig) -> tuple[list | None, dict | None]:
    """What can fail in seconds, before a model loads: the port, the ICE settings. The page's and
    the server's ICE configurations."""
    from .preflight import EXIT_PREFLIGHT, START_ERRORS, check_port

    try:  # seconds after the start, not after a model load, and before torch is imported
        check_port(cfg.host, cfg.port)
    except START_ERRORS as exc:
        log.error("%s", exc)
        raise NotStarted(EXIT_PREFLIGHT) from None
    from ..rtc.ice import IceConfigError, rtc_configs

    try:
        rtc, server_rtc = rtc_configs()  # before the model loads: a typo here should fail fast
    except IceConfigError as exc:
        log.error("cannot start: %s", exc)
        raise NotStarted(EXIT_PREFLIGHT) from None
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from ..rtc.patches import apply_media_settings

    apply_media_settings()  # the media workers apply the same settings
    return rtc, server_rtc


def start_room(cfg: AppConfig, server_rtc: dict | None) -> Topology:
    """The engines, their slot pools and the media workers."""
    from ..errors import CheckpointError
    from ..orchestration.topology import TopologyOptions, default_media_workers, resolve_devices, start_topology
    from ..runtime.build import RuntimeOptions, check_placement
    from ..serving.config import PoolConfig
    from .preflight import EXIT_PREFLIGHT, START_ERRORS, check_model_files

    def progress(message: str, fraction: float) -> None:
        log.info("loading: %s (%d%%)", message, round(100 * fraction))

    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    try:
        devices = resolve_devices(cfg.devices, cfg.device)
        if cfg.engines == "local":  # a Ray engine checks its own machine as it loads
            for device in devices:
                check_placement(device, cfg.dtype, cfg.weights)
            check_model_files(cfg.model, cfg.hf_repo, cache_dir, devices[0])
        slots_total = len(devices) * (cfg.slots if isinstance(cfg.slots, int) else cfg.max_slots)
        return start_topology(TopologyOptions(
            RuntimeOptions(model=cfg.model, device=cfg.device, dtype=cfg.dtype, weights=cfg.weights, slots=cfg.slots,
                           max_slots=cfg.max_slots, hf_repo=cfg.hf_repo, cache_dir=cache_dir,
                           context=context_frames(cfg.context, LMConfig().context)),
            PoolConfig(idle_release_seconds=cfg.idle_release, time_limit_seconds=cfg.time_limit,
                       max_queue=cfg.max_queue, max_wait_seconds=cfg.max_wait or None, admission=cfg.admission,
                       shed_when_overloaded=not cfg.no_shedding),
            devices=tuple(devices),
            media_workers=(cfg.media_workers if cfg.media_workers is not None
                           else default_media_workers(devices, slots_total)),
            server_rtc_configuration=server_rtc,
            engines=cfg.engines, ray_address=cfg.ray_address, api=api_config(cfg)), progress)
    except START_ERRORS as exc:  # before any model is loaded, or no room for one slot
        log.error("%s", exc)
        raise NotStarted(EXIT_PREFLIGHT) from None
    except (ValueError, CheckpointError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        raise NotStarted(1) from None


def serve(cfg: AppConfig, topology: Topology, rtc: list | None, server_rtc: dict | None
          ) -> tuple[Any, RecordingStore, str]:
    """The page on `cfg.port` until a stop signal: (the page, its recordings, the signal)."""
    from ..web.page import PageOptions, build_ui
    from ..web.recording import RecordingStore, remove_stale_recordings

    runtime, room = topology.runtime, topology.room
    door = api_doors(cfg, topology)
    if runtime.banner:
        log.warning("%s", runtime.banner)
    notice = None
    if rtc is None and (os.environ.get("SPACE_ID") or cfg.share):
        notice = ("No TURN relay is configured (set HF_TOKEN, on a Space as a secret, or PERSONAPLEX_ICE_SERVERS), "
                  "so calls from most networks will not connect.")
        log.warning("%s", notice)
    remove_stale_recordings()
    # Per-call WAV + transcript for the download buttons, deleted on exit (the media workers' own when there are any).
    recordings = topology.media.recordings if topology.media is not None else RecordingStore()
    demo = build_ui(runtime, room, PageOptions(time_limit=cfg.time_limit, rtc_configuration=rtc,
                                               server_rtc_configuration=server_rtc, notice=notice), recordings)
    if topology.media is not None:
        topology.media.page.attach(webrtc_of(demo))
        if door is not None:  # the API sockets are served where the media is
            topology.media.sockets.serve(door, lambda: demo.server)
    stop = StopSignals()
    stop.install()
    try:
        # One server for the page, fastrtc's endpoints and the JSON routes, with or without --share.
        # quiet: Gradio's own prints (its URL, and a hint about launch(share=True)) give way to the lines below.
        try:
            demo.launch(server_name=cfg.host, server_port=cfg.port, share=cfg.share, quiet=not cfg.verbose,
                        prevent_thread_lock=True,
                        app_kwargs=server_parts(cfg, topology, door, demo))
        except OSError:
            log.error("cannot serve on %s:%d: the port is in use or the address is not this machine's; "
                      "choose another with --port or --host", cfg.host, cfg.port)
            raise NotStarted(1) from None
        log.info("serving on http://%s:%d (status: /api/status, metrics: /metrics%s)", cfg.host, cfg.port,
                 f", Realtime API: ws://{cfg.host}:{cfg.port}/v1/realtime, GPT-Live: ws://{cfg.host}:{cfg.port}"
                 f"/v1/live/sessions, NVIDIA's protocol: ws://{cfg.host}:{cfg.port}/api/chat" if door else "")
        if demo.share_url:
            log.info("public link: %s", demo.share_url)
        elif cfg.share:  # Gradio says why with a print: a DEBUG record here (PrintsToLog)
            log.warning("no public link: Gradio could not create one (--verbose shows its message)")
        if topology.media is not None:
            page_second(demo.server)
        return demo, recordings, stop.wait()
    except BaseException:
        topology.close()
        recordings.close()
        raise


def api_doors(cfg: AppConfig, topology: Topology):
    """The API doors on the room (api/doors.py), or None with --no-api."""
    if cfg.no_api:
        return None
    from ..api.doors import ApiDoors

    if cfg.api_key is not None and cfg.chat_without_key and not cfg.no_chat:
        log.warning("/api/chat is open without a key (--chat-without-key): anyone who reaches this port can call "
                    "through NVIDIA's protocol")
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the API sockets (/v1/realtime, /v1/live/sessions, /api/chat) are open to anyone who reaches "
                    "this port: set --api-key (PERSONAPLEX_API_KEY) to require a key, or --no-api to turn them off")
    log.info("the phone door is %s", "on: POST /telephony/twilio is the numbers' voice webhook" if
             cfg.twilio_auth_token else "off (set TWILIO_AUTH_TOKEN to take calls from Twilio numbers)")
    return ApiDoors(topology.room, topology.runtime.engine,
                    replace(api_config(cfg), model_name=topology.runtime.model_name))


def api_config(cfg: AppConfig):
    """The API doors' settings (None with --no-api), for the main process and the media workers."""
    if cfg.no_api:
        return None
    from ..api.config import ApiConfig

    return ApiConfig(api_key=cfg.api_key, max_sockets_per_client=cfg.api_max_sockets, chat=not cfg.no_chat,
                     chat_without_key=cfg.chat_without_key, trust_forwarded_for=cfg.trust_forwarded_for,
                     twilio_auth_token=cfg.twilio_auth_token)


def server_parts(cfg: AppConfig, topology: Topology, door, demo) -> dict[str, list]:
    """The web server's own routes (status, metrics, the API doors) and its middleware, outermost
    first: a refused visitor costs no more than a lookup (web/visitor_limits.py, web/page_cache.py)."""
    from starlette.middleware import Middleware

    from ..serving.room import DOOR_PAGE
    from ..web.deeplink import RefuseLongQueries
    from ..web.page import call_events, status_routes
    from ..web.page_cache import PageCache
    from ..web.prometheus import EngineCollector, VisitorCollector, metrics_routes
    from ..web.visitor_limits import VisitorCounts, VisitorLimits

    room, visitors = topology.room, VisitorCounts()
    routes = (status_routes(topology.runtime, room, lambda: {**topology.status(), "visitors": visitors.as_dict(),
                                                             **(door.status() if door is not None else {})})
              + metrics_routes(room, [EngineCollector(topology.engine_status),
                                      VisitorCollector(visitors.as_dict),
                                      *(door.doors.values() if door else ())],
                               doors=(DOOR_PAGE, *(door.doors if door else ())))
              + (door.routes() if door else []))
    return {"routes": routes,
            "middleware": [Middleware(RefuseLongQueries),
                           Middleware(VisitorLimits, call_events=call_events(demo), counts=visitors,
                                      page_loads_per_minute=cfg.page_loads_per_minute,
                                      trust_forwarded_for=cfg.trust_forwarded_for),
                           Middleware(PageCache)]}


def page_second(server) -> None:
    """Live calls first, on the cores too: with the media and the engines in processes of their own,
    the web server's thread runs at a lower priority, so that a burst of visitors takes the cores the
    calls leave and never the other way round. Threads it starts later (Gradio's workers) inherit it."""
    thread = getattr(server, "thread", None)
    if sys.platform != "linux" or thread is None or thread.native_id is None:
        return  # a thread's own priority is a Linux feature; elsewhere it would lower the whole app
    try:
        os.setpriority(os.PRIO_PROCESS, thread.native_id, PAGE_NICENESS)
    except OSError as exc:
        log.warning("could not lower the web server's priority: %s", exc)


def shut_down_app(demo: Any, recordings: RecordingStore, received: str, topology: Topology) -> None:
    """End every call with a message, stop the web server, delete the recordings, stop the processes."""
    from ..procs.launcher import kill_children

    rtc_component = webrtc_of(demo)
    # A call is a peer connection here, or a connection mirrored from a media worker.
    calls = rtc_component.pcs or rtc_component.connections
    log.info("%s: ending %d call(s) with a message, then exiting", received, len(calls))

    def stop_web_server() -> None:
        from gradio.tunneling import CURRENT_TUNNELS

        if demo.server is not None:
            close_connections(demo.server)
            demo.server.force_exit = True  # an open tab keeps an event stream open: do not wait for it
        demo.close(verbose=False)
        for tunnel in CURRENT_TUNNELS:  # the --share link's process, as Gradio's own Ctrl-C path does
            tunnel.kill()

    def let_callers_hear_why() -> None:  # each handler sends its caller the message and closes
        deadline = time.monotonic() + 3.0
        while (rtc_component.pcs or rtc_component.connections) and time.monotonic() < deadline:
            time.sleep(0.05)

    shut_down([("end the calls and stop the pool", lambda: topology.end_calls(join_timeout=3.0)),
               ("let the callers hear why", let_callers_hear_why),
               ("stop the web server", stop_web_server),
               ("delete the recordings", recordings.close),
               ("stop the media workers and engines", topology.close)],
              on_timeout=lambda: (recordings.close(), kill_children()))


def webrtc_of(demo):
    """The page's fastrtc WebRTC component."""
    from fastrtc import WebRTC

    return next(b for b in demo.blocks.values() if isinstance(b, WebRTC))


def close_connections(server, timeout: float = 2.0) -> None:
    """End the web server's open connections and its lifespan on its own loop before a forced exit:
    forced, uvicorn would cancel both and log each as an error with a `CancelledError` traceback."""
    import asyncio
    import concurrent.futures

    state, servers = getattr(server, "server_state", None), getattr(server, "servers", None)
    if state is None or not servers:
        return  # not started, or already stopped

    async def close() -> None:
        for connection in list(state.connections):
            connection.transport.close()
        deadline = asyncio.get_running_loop().time() + timeout / 2
        while state.tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if getattr(server, "lifespan", None) is not None:
            await server.lifespan.shutdown()

    try:
        done = asyncio.run_coroutine_threadsafe(close(), servers[0].get_loop())
        done.result(timeout)
    except concurrent.futures.TimeoutError:
        done.cancel()
        log.warning("the web server's connections did not close within %.0f s", timeout)
    except Exception as exc:  # the loop has stopped already, or a connection would not close: exit anyway
        log.warning("closing the web server's connections: %s", exc)


class PrintsToLog(io.TextIOBase):
    """`sys.stdout` of the app's main process: each printed line becomes a DEBUG record of the logger
    "print" (INFO with --verbose), so a library's chatter (Gradio 5.50 prints a line per WebRTC
    offer) never interleaves with the log unformatted."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._partial = ""
        self._lock = threading.Lock()  # several threads may print
        self._log = logging.getLogger("print")

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if line.strip():
                self._log.log(self.level, "%s", line)
        return len(text)


if __name__ == "__main__":
    sys.exit(main())
