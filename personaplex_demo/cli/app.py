"""PersonaPlex Live: serve the page (`personaplex-live`, or `python app.py` in the repository).

Every setting is a field of `AppConfig`, declared once with its flag, env var and help; `--help` lists
them with their defaults.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..model.config import LMConfig
from ..runtime.capacity import DEFAULT_MAX_SLOTS, FRAME_RATE, MIN_CONTEXT_SECONDS, context_frames, parse_slots
from ..runtime.hub import CACHE_DIR_DEFAULT, CACHE_DIR_HELP, DEFAULT_HF_REPO, MODEL_CHOICES
from .options import at_least, between, build_parser, config_from, env_help, option, positive

log = logging.getLogger(__name__)

DESCRIPTION = ("PersonaPlex Live: talk with NVIDIA PersonaPlex-7B in the browser.\n"
               "Serves the page, the WebRTC calls and GET /api/status on one port.")

# Variables read outside AppConfig, listed in --help and the README with the config's own.
OTHER_ENV = {
    "HF_TOKEN": "a Hugging Face token: fetches the gated weights and TURN relay credentials",
    "SPACE_ID": "set by Hugging Face Spaces: the host defaults to 0.0.0.0",
    "PERSONAPLEX_LOOPBACK_ICE": "1: WebRTC on 127.0.0.1 only, without STUN (browser and server on one machine)",
    "PERSONAPLEX_ICE_SERVERS": "your own STUN/TURN servers for the page and the server, as JSON RTCIceServer "
                               "objects (instead of HF_TOKEN's)",
    "PERSONAPLEX_TURN_URL": "your own TURN server's URL, or several separated by commas",
    "PERSONAPLEX_TURN_USERNAME": "its username",
    "PERSONAPLEX_TURN_CREDENTIAL": "its password",
    "PERSONAPLEX_STUN_URL": "your own STUN server's URL",
    "PERSONAPLEX_ICE_RELAY_ONLY": "1: page and server use TURN relay candidates only",
}

MODEL_CONTEXT_SECONDS = LMConfig().context / FRAME_RATE  # 240 s

# Loggers that report every internal request at INFO; --verbose shows them.
CHATTY_LOGGERS = ("httpx", "httpcore")


@dataclass(frozen=True)
class AppConfig:
    model: str = option("auto", "auto: PersonaPlex-7B when a CUDA GPU exists and its weights can be fetched, else "
                        "the tiny offline model (with a banner); personaplex-7b-v1: fail instead of falling back; "
                        "tiny: never touches the network", env="PERSONAPLEX_MODEL", choices=MODEL_CHOICES)
    device: str = option("auto", "auto, cpu, cuda or cuda:N", env="PERSONAPLEX_DEVICE")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16",
                        env="PERSONAPLEX_DTYPE")
    slots: int | str = option("auto", "simultaneous conversations, one batch row each; auto: as many as the GPU "
                              "memory holds (4 on a CPU)", env="PERSONAPLEX_SLOTS", parse=parse_slots, metavar="N")
    max_slots: int = option(DEFAULT_MAX_SLOTS, "the most slots --slots auto may choose", env="PERSONAPLEX_MAX_SLOTS",
                            check=at_least(1), metavar="N")
    context: float | None = option(None, "seconds of conversation the model attends to; shorter holds less memory "
                                   "per slot, so more callers fit; longer calls keep running", env="PERSONAPLEX_CONTEXT",
                                   check=between(MIN_CONTEXT_SECONDS, MODEL_CONTEXT_SECONDS),
                                   shown_default=f"{MODEL_CONTEXT_SECONDS:g}, the model's window", metavar="SECONDS")
    time_limit: float = option(300.0, "seconds per call, counted from the moment it is live (waiting in the "
                               "queue does not count)", env="PERSONAPLEX_TIME_LIMIT", check=positive, metavar="SECONDS")
    idle_release: float = option(2.0, "free a slot after this many seconds without microphone audio (a closed tab)",
                                 env="PERSONAPLEX_IDLE_RELEASE", check=positive, metavar="SECONDS")
    max_queue: int = option(32, "callers who may wait for a slot, with their place in the queue shown; 0 turns "
                            "callers away while every slot is busy", env="PERSONAPLEX_MAX_QUEUE", check=at_least(0))
    host: str = option("127.0.0.1", "address to listen on; 0.0.0.0 for every network interface",
                       env="PERSONAPLEX_HOST")
    port: int = option(7860, "port to listen on", env="PERSONAPLEX_PORT", check=between(1, 65535))
    share: bool = option(False, "also serve on a public Gradio link (calls then need a TURN relay: set HF_TOKEN)",
                         env="PERSONAPLEX_SHARE")
    hf_repo: str = option(DEFAULT_HF_REPO, "Hugging Face repository of the real model", env="PERSONAPLEX_HF_REPO",
                          metavar="REPO")
    cache_dir: str | None = option(None, CACHE_DIR_HELP, env="PERSONAPLEX_CACHE", shown_default=CACHE_DIR_DEFAULT,
                                   metavar="DIR")
    devices: str | None = option(None, "several engines, one process per device: cuda:0,cuda:1,... or all (every "
                                 "GPU); cpu,cpu runs two tiny engines. --slots counts per engine",
                                 env="PERSONAPLEX_DEVICES", shown_default="one engine on --device", metavar="LIST")
    media_workers: int | None = option(None, "processes that carry the callers' WebRTC media and call handlers "
                                       "(Opus, RTP, page updates); 0 keeps them in this process",
                                       env="PERSONAPLEX_MEDIA_WORKERS", check=at_least(0),
                                       shown_default="0 on a CPU; on a CUDA host cores - 2, at most one per slot",
                                       metavar="N")
    verbose: bool = option(False, "also log each internal HTTP request and Gradio's own startup messages",
                           env="PERSONAPLEX_VERBOSE")


def parse_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> AppConfig:
    """Flags win over env vars, env vars over the defaults of AppConfig."""
    environ = os.environ if environ is None else environ
    presets = {"host": ("0.0.0.0", "on a Hugging Face Space")} if environ.get("SPACE_ID") else {}
    parser = build_parser(AppConfig, environ, presets, description=DESCRIPTION,
                          epilog=env_help(AppConfig, OTHER_ENV))
    return config_from(AppConfig, parser.parse_args(argv))


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    from ..runtime.hub import install_secret_filter

    install_secret_filter()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    setup_logging(cfg.verbose)
    from .preflight import EXIT_PREFLIGHT, START_ERRORS, check_model_files, check_port

    try:  # seconds after the start, not after a model load, and before torch is imported
        check_port(cfg.host, cfg.port)
    except START_ERRORS as exc:
        log.error("%s", exc)
        return EXIT_PREFLIGHT
    from ..rtc.ice import IceConfigError, rtc_configs

    try:
        rtc, server_rtc = rtc_configs()  # before the model loads: a typo here should fail fast
    except IceConfigError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_PREFLIGHT
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from ..rtc.settings import apply_media_settings, loopback_requested

    apply_media_settings(loopback_requested())  # the media workers apply the same settings

    from starlette.middleware import Middleware

    from ..errors import CheckpointError
    from ..procs.topology import TopologyOptions, default_media_workers, resolve_devices, start_topology
    from ..runtime.build import RuntimeOptions, check_placement
    from ..serving.config import PoolConfig
    from ..web.deeplink import RefuseLongQueries
    from ..web.page import PageOptions, build_ui, status_routes
    from ..web.prometheus import metrics_routes
    from ..web.recording import RecordingStore
    from .lifecycle import StopSignals, exit_now, remove_stale_recordings, shut_down, wait_until

    def progress(message: str, fraction: float) -> None:
        log.info("loading: %s (%d%%)", message, round(100 * fraction))

    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    try:
        devices = resolve_devices(cfg.devices, cfg.device)
        for device in devices:
            check_placement(device, cfg.dtype)
        check_model_files(cfg.model, cfg.hf_repo, cache_dir, devices[0])
        slots_total = len(devices) * (cfg.slots if isinstance(cfg.slots, int) else cfg.max_slots)
        topology = start_topology(TopologyOptions(
            RuntimeOptions(model=cfg.model, device=cfg.device, dtype=cfg.dtype, slots=cfg.slots,
                           max_slots=cfg.max_slots, hf_repo=cfg.hf_repo, cache_dir=cache_dir,
                           context=context_frames(cfg.context, LMConfig().context)),
            PoolConfig(idle_release_seconds=cfg.idle_release, time_limit_seconds=cfg.time_limit,
                       max_queue=cfg.max_queue),
            devices=tuple(devices),
            media_workers=(cfg.media_workers if cfg.media_workers is not None
                           else default_media_workers(devices, slots_total)),
            server_rtc_configuration=server_rtc, loopback_ice=loopback_requested()), progress)
    except START_ERRORS as exc:  # before any model is loaded, or no room for one slot
        log.error("%s", exc)
        return EXIT_PREFLIGHT
    except (ValueError, CheckpointError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    runtime, pool = topology.runtime, topology.pool
    if runtime.banner:
        log.warning("%s", runtime.banner)
    notice = None
    if rtc is None and (os.environ.get("SPACE_ID") or cfg.share):
        notice = ("No TURN relay is configured (set HF_TOKEN, on a Space as a secret, or PERSONAPLEX_ICE_SERVERS), "
                  "so calls from most networks will not connect.")
        log.warning("%s", notice)
    remove_stale_recordings()
    # Per-call WAV + transcript for the download buttons, deleted on exit (the media workers keep
    # them when there are any).
    recordings = topology.recordings or RecordingStore()
    demo = build_ui(runtime, pool, PageOptions(time_limit=cfg.time_limit, max_queue=pool.config.max_queue or 0,
                                               rtc_configuration=rtc, server_rtc_configuration=server_rtc,
                                               notice=notice), recordings)
    topology.attach(demo)
    stop = StopSignals()
    stop.install()
    try:
        # One server for the page, fastrtc's endpoints and the JSON routes, with or without --share.
        # quiet: Gradio's own prints (its URL, and a hint about launch(share=True)) give way to the lines below.
        try:
            demo.launch(server_name=cfg.host, server_port=cfg.port, share=cfg.share, quiet=not cfg.verbose,
                        prevent_thread_lock=True,
                        app_kwargs={"routes": status_routes(runtime, pool, topology.status) + metrics_routes(pool),
                                    "middleware": [Middleware(RefuseLongQueries)]})
        except OSError:
            log.error("cannot serve on %s:%d: the port is in use or the address is not this machine's; "
                      "choose another with --port or --host", cfg.host, cfg.port)
            topology.close()
            recordings.close()
            return 1
        log.info("serving on http://%s:%d (status: /api/status, metrics: /metrics)", cfg.host, cfg.port)
        if demo.share_url:
            log.info("public link: %s", demo.share_url)
        received = stop.wait()
    except BaseException:
        topology.close()
        recordings.close()
        raise
    from fastrtc import WebRTC

    rtc_component = next(b for b in demo.blocks.values() if isinstance(b, WebRTC))
    # A call is a peer connection here, or a connection mirrored from a media worker.
    calls = rtc_component.pcs or rtc_component.connections
    log.info("%s: ending %d call(s) with a message, then exiting", received, len(calls))

    def stop_web_server() -> None:
        from gradio.tunneling import CURRENT_TUNNELS

        if demo.server is not None:
            demo.server.force_exit = True  # an open tab keeps an event stream open: do not wait for it
        demo.close(verbose=False)
        for tunnel in CURRENT_TUNNELS:  # the --share link's process, as Gradio's own Ctrl-C path does
            tunnel.kill()

    shut_down([("end the calls and stop the pool", lambda: topology.end_calls(join_timeout=3.0)),
               # Each handler sends its caller the message and closes; give that a moment to arrive.
               ("let the callers hear why",
                lambda: wait_until(lambda: not rtc_component.pcs and not rtc_component.connections, 3.0)),
               ("stop the web server", stop_web_server),
               ("delete the recordings", recordings.close),
               ("stop the media workers and engines", topology.close)],
              on_timeout=recordings.close)
    exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
