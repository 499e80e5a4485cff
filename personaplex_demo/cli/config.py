"""The app's settings: `AppConfig`, every field declared once with its flag, env var and help
(cli/options.py). The offline CLI takes its model flags from here too."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..model.config import INT8_FLOAT16, WEIGHTS, LMConfig
from ..runtime.capacity import DEFAULT_MAX_SLOTS, DTYPE_NAMES, FRAME_RATE, MIN_CONTEXT_SECONDS, parse_slots
from ..runtime.hub import CACHE_DIR_DEFAULT, CACHE_DIR_HELP, DEFAULT_HF_REPO, MODEL_CHOICES
from ..serving.config import ADMISSIONS, DEFAULT_MAX_WAIT_SECONDS
from .options import add_options, at_least, between, env_help, option, positive

DTYPE_CHOICES = ("auto", *DTYPE_NAMES)

DESCRIPTION = ("PersonaPlex Live: talk with NVIDIA PersonaPlex-7B in the browser.\n"
               "Serves the page, the WebRTC calls, the API doors (/v1/realtime, /v1/live/sessions, /api/chat, "
               "the phone door) and GET /api/status on one port.")

# Variables read outside AppConfig, listed in --help and docs/configuration.md with the config's own.
OTHER_ENV = {
    "HF_TOKEN": "a Hugging Face token: fetches the gated weights and TURN relay credentials",
    "SPACE_ID": "set by Hugging Face Spaces: the host defaults to 0.0.0.0, --trust-forwarded-for to on",
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
ENGINE_KINDS = ("local", "ray")
NEEDS_RAY = "--engines ray needs Ray, an optional extra: pip install -r requirements-ray.txt"

# Loggers that report every internal request at INFO; --verbose shows them.
CHATTY_LOGGERS = ("httpx", "httpcore")


@dataclass(frozen=True)
class AppConfig:
    model: str = option("auto", "auto: PersonaPlex-7B when a CUDA GPU exists and its weights can be fetched, else "
                        "the tiny offline model (with a banner); personaplex-7b-v1: fail instead of falling back; "
                        "tiny: never touches the network", env="PERSONAPLEX_MODEL", choices=MODEL_CHOICES)
    device: str = option("auto", "auto, cpu, cuda or cuda:N", env="PERSONAPLEX_DEVICE")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16",
                        env="PERSONAPLEX_DTYPE", choices=DTYPE_CHOICES)
    weights: str = option("dense", "dense: the language model's weights in the --dtype; int8: its transformer layers' "
                          "weights as int8 with a scale per row, about half the memory of bfloat16 (their effect "
                          "on conversation quality with the real weights is not measured)",
                          env="PERSONAPLEX_WEIGHTS", choices=WEIGHTS)
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
    max_wait: float = option(DEFAULT_MAX_WAIT_SECONDS, "seconds a caller may wait in the queue before being asked "
                             "to come back later; 0: no limit", env="PERSONAPLEX_MAX_WAIT", check=at_least(0),
                             metavar="SECONDS")
    admission: str = option("headroom", "headroom: seat a caller only while the measured tick time leaves room for one "
                            "more (the rest wait in the queue, told why); slots: every free slot is taken",
                            env="PERSONAPLEX_ADMISSION", choices=ADMISSIONS)
    no_shedding: bool = option(False, "keep every call when the tick stays over its 80 ms budget; by default (with "
                               "--admission headroom) the newest call is ended so that the others keep real time",
                               env="PERSONAPLEX_NO_SHEDDING")
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
                                       shown_default="at most one per slot: cores - 2 on a CUDA host, cores / 4 "
                                       "on a CPU (at least 1; 0 on one core)",
                                       metavar="N")
    engines: str = option("local", "local: the engines run on this machine (--device, --devices); ray: as Ray actors "
                          "on the machines of a Ray cluster, one per GPU (needs requirements-ray.txt; "
                          "docs/operations.md, \"Several machines\")", env="PERSONAPLEX_ENGINES", choices=ENGINE_KINDS)
    ray_address: str | None = option(None, "the Ray cluster for --engines ray: auto (the one `ray start` joined on "
                                     "this machine) or HOST:PORT", env="PERSONAPLEX_RAY_ADDRESS",
                                     shown_default="a Ray started on this machine", metavar="ADDRESS")
    no_api: bool = option(False, "turn off every API door: the WebSockets of OpenAI-Realtime (/v1/realtime), "
                          "GPT-Live (/v1/live/sessions) and NVIDIA's protocol (/api/chat), and the phone door "
                          "(calls from code and from phones)", env="PERSONAPLEX_NO_API",
                          formerly=("--no-realtime", "PERSONAPLEX_NO_REALTIME"))
    api_key: str | None = option(None, "the key every API socket must send (Authorization: Bearer KEY); on a "
                                 "Space, set it as a secret",
                                 env="PERSONAPLEX_API_KEY", secret=True,
                                 shown_default="none: the socket is open to anyone who can reach the port",
                                 metavar="KEY")
    api_max_sockets: int = option(4, "open API sockets (every API door together) per client address, so that one "
                                  "script cannot take the room (a phone network's calls are not counted: each "
                                  "comes through a signed webhook)", env="PERSONAPLEX_API_MAX_SOCKETS",
                                  check=at_least(1), metavar="N",
                                  formerly=("--realtime-max-sockets", "PERSONAPLEX_REALTIME_MAX_SOCKETS"))
    no_chat: bool = option(False, "turn off /api/chat, NVIDIA's PersonaPlex server protocol (its web client, "
                           "LiveKit's PersonaPlex plugin)", env="PERSONAPLEX_NO_CHAT")
    chat_without_key: bool = option(False, "with --api-key, still open /api/chat to clients that send no key (the "
                                    "reference protocol has none, LiveKit's plugin cannot add one)",
                                    env="PERSONAPLEX_CHAT_WITHOUT_KEY")
    twilio_auth_token: str | None = option(None, "the Twilio account's auth token: turns on the phone door "
                                           "(POST /telephony/twilio, the number's voice webhook; docs/phone.md) and "
                                           "checks every webhook's signature with it", env="TWILIO_AUTH_TOKEN",
                                           secret=True, shown_default="none: the phone door is off", metavar="TOKEN")
    trust_forwarded_for: bool = option(False, "behind a proxy that sets X-Forwarded-For (a Space's): take a "
                                       "client's address from its last hop, for the per-address limits; "
                                       "elsewhere a client could name any address", env="PERSONAPLEX_TRUST_FORWARDED_FOR")
    page_loads_per_minute: int = option(60, "page loads a minute from one client address, half of them at once, and "
                                        "ten times as many of the page's other visitor requests; beyond that the "
                                        "address is asked to wait (calls are never limited); 0: no limit",
                                        env="PERSONAPLEX_PAGE_LOADS_PER_MINUTE", check=at_least(0), metavar="N")
    verbose: bool = option(False, "also log each internal HTTP request and Gradio's own startup messages",
                           env="PERSONAPLEX_VERBOSE")


def parse_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> AppConfig:
    """Flags win over env vars, env vars over the defaults of AppConfig."""
    environ = os.environ if environ is None else environ
    presets = ({"host": ("0.0.0.0", "on a Hugging Face Space"), "trust_forwarded_for": (True, "on a Hugging Face "
                "Space")} if environ.get("SPACE_ID") else {})
    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION,
                                     epilog=env_help(AppConfig, OTHER_ENV))
    add_options(parser, AppConfig, environ, presets)
    cfg = AppConfig(**vars(parser.parse_args(argv)))
    if cfg.weights == "int8" and DTYPE_NAMES.get(cfg.dtype) == "float16":
        parser.error(INT8_FLOAT16)  # one line, exit 2, before anything loads
    if cfg.engines == "ray":
        if cfg.devices:
            parser.error("--devices is for --engines local; with --engines ray every GPU of the cluster runs an engine")
        if importlib.util.find_spec("ray") is None:
            parser.error(NEEDS_RAY)
    elif cfg.ray_address:
        parser.error("--ray-address is for --engines ray")
    return cfg
