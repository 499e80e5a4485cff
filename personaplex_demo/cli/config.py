"""The app's settings: `AppConfig`, each field declared once with `option(...)`: its flag, environment
variable, help and checks. A flag wins over its variable, a variable over the field's default; a bad
value from either is a one-line parser error. The offline CLI takes its model flags from here too."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..model.config import INT8_FLOAT16, WEIGHTS, LMConfig
from ..runtime.capacity import DEFAULT_MAX_SLOTS, DTYPE_NAMES, FRAME_RATE, MIN_CONTEXT_SECONDS, parse_slots
from ..runtime.hub import CACHE_DIR_DEFAULT, CACHE_DIR_HELP, DEFAULT_HF_REPO, MODEL_CHOICES
from ..serving.config import ADMISSIONS, DEFAULT_MAX_WAIT_SECONDS

Check = Callable[[Any], str | None]  # a complaint about a value, or None when it is fine

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KIND_WORDS = {int: "a whole number", float: "a number"}


@dataclass(frozen=True)
class Option:
    help: str
    env: str | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    shown_default: str | None = None  # what --help and the docs show when the default is a placeholder (None)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text to value for a type of its own; a ValueError says what is wrong
    secret: bool = False  # --help says whether it is set, never the value
    # The flag's and the variable's former names, still taken (a rename never breaks a command line).
    formerly: tuple[str, ...] = ()


def option(default: Any, help: str, **settings: Any) -> Any:
    """A dataclass field that is also a command-line flag (`--field-name`) and, with `env`, a variable;
    `settings` are `Option`'s."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **settings)})


def at_least(minimum: float) -> Check:
    return lambda value: None if value >= minimum else f"must be at least {minimum:g}"


def between(low: float, high: float) -> Check:
    return lambda value: None if low <= value <= high else f"must be between {low:g} and {high:g}"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


@dataclass(frozen=True)
class Spec:
    """One option as the parser sees it: the field's name, its plain type, its default and its Option."""

    name: str
    kind: type
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def shown(self, value: Any) -> str:
        """A value as --help and the docs write it."""
        if value is None:
            return self.option.shown_default or "none"
        if self.kind is bool:
            return "on" if value else "off"
        if self.kind is float:
            return f"{value:g}"
        return str(value)

    def convert(self, text: str) -> Any:
        """Text from the command line or the environment to a checked value; argparse reports the error."""
        text = text.strip()
        if self.option.parse is not None:
            try:
                value: Any = self.option.parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        elif self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(_TRUE + _FALSE)}")
            value = text.lower() in _TRUE
        else:
            try:
                value = self.kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not {_KIND_WORDS.get(self.kind, self.kind.__name__)}"
                                                 ) from None
        if self.option.choices and value not in self.option.choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(self.option.choices)}")
        complaint = self.option.check(value) if self.option.check else None
        if complaint:
            raise argparse.ArgumentTypeError(f"{complaint}, not {text}")
        return value


def specs(cls: type) -> list[Spec]:
    """The options of dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    result = []
    for f in dataclasses.fields(cls):
        if (opt := f.metadata.get("option")) is not None:
            plain = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]  # `str | None` -> str
            result.append(Spec(f.name, plain[0] if plain else hints[f.name], f.default, opt))
    return result


def env_help(cls: type, extra: Mapping[str, str] | None = None) -> str:
    """The environment variables, one per line, for the end of --help."""
    rows = [(s.option.env, s.flag) for s in specs(cls) if s.option.env] + list((extra or {}).items())
    width = max(len(name) for name, _ in rows) + 2
    return "environment variables (a flag wins over its variable, a variable over the default):\n" + "\n".join(
        f"  {name.ljust(width)}{meaning}" for name, meaning in rows)


def add_options(parser: argparse.ArgumentParser, cls: type, environ: Mapping[str, str],
                presets: Mapping[str, tuple[Any, str]] | None = None, names: tuple[str, ...] | None = None) -> None:
    """The flags of `cls`'s options (all, or those in `names`) on `parser`. `presets` maps a field to a
    (default, reason) that stands in for its own default (the host on a Space); its variable still wins.
    An invalid variable in `environ` exits here, with status 2 as argparse does for a bad flag."""
    for spec in specs(cls):
        if names is not None and spec.name not in names:
            continue
        default, source = (presets or {}).get(spec.name, (spec.default, None))
        old_flags = [name for name in spec.option.formerly if name.startswith("--")]
        variables = [spec.option.env] if spec.option.env else []
        variables += [name for name in spec.option.formerly if not name.startswith("--")]
        variable = next((name for name in variables if environ.get(name, "").strip()), None)
        if variable is not None:  # an empty variable counts as unset
            try:
                default = spec.convert(environ[variable])
            except argparse.ArgumentTypeError as exc:  # one line, without the usage text a flag error has
                parser.exit(2, f"{parser.prog}: error: {variable}: {exc}\n")
            source = f"from {variable}"
        shown = ("set" if spec.option.secret and default else spec.shown(default)) + (f", {source}" if source else "")
        formerly = f" (formerly {' and '.join(spec.option.formerly)}, still taken)" if spec.option.formerly else ""
        help_text = f"{spec.option.help} (default: {shown}){formerly}".replace("%", "%%")
        if spec.kind is bool:
            parser.add_argument(spec.flag, *old_flags, dest=spec.name, action="store_true", default=default,
                                help=help_text)
        else:
            metavar = spec.option.metavar or ("{" + ",".join(spec.option.choices) + "}" if spec.option.choices
                                              else spec.name.upper())
            parser.add_argument(spec.flag, *old_flags, dest=spec.name, type=spec.convert, default=default,
                                metavar=metavar, help=help_text)


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
