"""PersonaPlex Live: `python app.py` serves the page (flags and env vars below)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("personaplex_demo.app")


@dataclass(frozen=True)
class AppConfig:
    model: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    slots: int = 4
    time_limit: float = 300.0
    idle_release: float = 2.0
    max_queue: int = 32
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    hf_repo: str = "nvidia/personaplex-7b-v1"
    cache_dir: str | None = None


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


# field -> (env var, type); the one place where flags and env vars meet the config.
ENV = {
    "model": ("PERSONAPLEX_MODEL", str), "device": ("PERSONAPLEX_DEVICE", str), "dtype": ("PERSONAPLEX_DTYPE", str),
    "slots": ("PERSONAPLEX_SLOTS", int), "time_limit": ("PERSONAPLEX_TIME_LIMIT", float),
    "idle_release": ("PERSONAPLEX_IDLE_RELEASE", float), "max_queue": ("PERSONAPLEX_MAX_QUEUE", int),
    "host": ("PERSONAPLEX_HOST", str), "port": ("PERSONAPLEX_PORT", int), "share": ("PERSONAPLEX_SHARE", _flag),
    "hf_repo": ("PERSONAPLEX_HF_REPO", str), "cache_dir": ("PERSONAPLEX_CACHE", str),
}


def parse_config(argv: list[str] | None = None) -> AppConfig:
    """Flags win over env vars, env vars over the defaults of AppConfig."""
    base = AppConfig()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every flag can also be set by an env var: "
               + ", ".join(f"--{k.replace('_', '-')}={v}" for k, (v, _) in ENV.items())
               + ".\nPERSONAPLEX_LOOPBACK_ICE=1 keeps WebRTC on 127.0.0.1 (tests; browser and server on one "
                 "machine without a network).\nHF_TOKEN: the gated weights and TURN relay credentials.")
    env = {}
    for key, (var, kind) in ENV.items():
        if os.environ.get(var):
            try:
                env[key] = kind(os.environ[var])
            except ValueError:
                p.error(f"{var}={os.environ[var]!r} is not a valid {kind.__name__}")
    if os.environ.get("SPACE_ID"):  # on a Hugging Face Space, listen on all interfaces
        env.setdefault("host", "0.0.0.0")
    p.add_argument("--model", choices=["auto", "personaplex-7b-v1", "tiny"], default=env.get("model", base.model),
                   help="auto: the real model when it can be fetched and a GPU exists, else the tiny offline one")
    p.add_argument("--device", default=env.get("device", base.device), help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=env.get("dtype", base.dtype), help="auto (bf16 on CUDA), float32, bfloat16")
    p.add_argument("--slots", type=int, default=env.get("slots", base.slots), help="simultaneous conversations")
    p.add_argument("--time-limit", type=float, default=env.get("time_limit", base.time_limit),
                   help="seconds per call, counted from the moment it is live (queueing does not count)")
    p.add_argument("--idle-release", type=float, default=env.get("idle_release", base.idle_release),
                   help="free a slot after this many seconds without microphone audio")
    p.add_argument("--max-queue", type=int, default=env.get("max_queue", base.max_queue),
                   help="callers who may wait for a slot, with their position shown; 0 refuses when full")
    p.add_argument("--host", default=env.get("host", base.host))
    p.add_argument("--port", type=int, default=env.get("port", base.port))
    p.add_argument("--share", action="store_true", default=env.get("share", base.share),
                   help="a public Gradio link (needs TURN: set HF_TOKEN)")
    p.add_argument("--hf-repo", default=env.get("hf_repo", base.hf_repo))
    p.add_argument("--cache-dir", default=env.get("cache_dir", base.cache_dir),
                   help="where the tiny offline model is built")
    a = p.parse_args(argv)
    if a.slots < 1:
        p.error("--slots must be at least 1")
    if a.time_limit <= 0 or a.idle_release <= 0 or a.max_queue < 0:
        p.error("--time-limit and --idle-release must be positive and --max-queue at least 0")
    return AppConfig(a.model, a.device, a.dtype, a.slots, a.time_limit, a.idle_release, a.max_queue, a.host, a.port,
                     a.share, a.hf_repo, a.cache_dir)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from personaplex_demo.hub import install_secret_filter

    install_secret_filter()


def rtc_configs():
    """TURN relays for Spaces and share links; direct host candidates otherwise."""
    if not os.environ.get("HF_TOKEN"):
        return None, None
    from fastrtc import get_cloudflare_turn_credentials, get_cloudflare_turn_credentials_async

    try:
        server = get_cloudflare_turn_credentials(ttl=360_000)
    except Exception as e:  # no network to the TURN service: the page can still try direct routes
        log.warning("TURN credentials unavailable (%s); calls need a direct route", type(e).__name__)
        return None, None
    return get_cloudflare_turn_credentials_async, server


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    setup_logging()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if os.environ.get("PERSONAPLEX_LOOPBACK_ICE") == "1":
        # Testing and offline use on one machine: aioice skips 127.0.0.1 unless told otherwise.
        import aioice.ice

        aioice.ice.get_host_addresses = lambda use_ipv4=True, use_ipv6=False: ["127.0.0.1"]
    import aioice.ice

    # Notice a closed tab in ~4 s instead of ~30 s, so its slot frees quickly.
    aioice.ice.CONSENT_INTERVAL, aioice.ice.CONSENT_FAILURES = 1, 4
    from personaplex_demo.rtc_audio import install_packet_encoder

    install_packet_encoder()  # agent audio in 40 ms Opus packets: half the per-packet work per caller

    from personaplex_demo.loading import RuntimeOptions, build_runtime
    from personaplex_demo.pool import PoolConfig, SlotPool
    from personaplex_demo.recording import RecordingStore
    from personaplex_demo.ui import PageOptions, build_ui, status_routes

    def progress(message: str, fraction: float) -> None:
        log.info("loading: %s (%d%%)", message, round(100 * fraction))

    runtime = build_runtime(RuntimeOptions(model=cfg.model, device=cfg.device, dtype=cfg.dtype, slots=cfg.slots,
                                           hf_repo=cfg.hf_repo,
                                           cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None), progress)
    if runtime.banner:
        log.warning("%s", runtime.banner)
    pool = SlotPool(runtime.engine, PoolConfig(idle_release_seconds=cfg.idle_release, time_limit_seconds=cfg.time_limit,
                                               max_queue=cfg.max_queue))
    pool.start()
    rtc, server_rtc = rtc_configs()
    if os.environ.get("PERSONAPLEX_LOOPBACK_ICE") == "1" and server_rtc is None:
        # No STUN on loopback: aiortc's default STUN host costs a DNS lookup per call, and on a
        # closed network that lookup can hang in an executor thread.
        server_rtc = {"iceServers": []}
    notice = None
    if rtc is None and (os.environ.get("SPACE_ID") or cfg.share):
        notice = ("No TURN relay is configured (set HF_TOKEN; on a Space, as a secret), so calls from most networks "
                  "will not connect.")
        log.warning("%s", notice)
    recordings = RecordingStore()  # per-call WAV + transcript for the download buttons, deleted on exit
    demo = build_ui(runtime, pool, PageOptions(time_limit=cfg.time_limit, max_queue=cfg.max_queue,
                                               rtc_configuration=rtc, server_rtc_configuration=server_rtc,
                                               notice=notice), recordings)
    try:
        log.info("serving on http://%s:%d (status: /api/status)", cfg.host, cfg.port)
        # One server for the page, fastrtc's endpoints and the JSON status route, with or without --share.
        demo.launch(server_name=cfg.host, server_port=cfg.port, share=cfg.share,
                    app_kwargs={"routes": status_routes(runtime, pool)})
    finally:
        pool.shutdown()
        recordings.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
