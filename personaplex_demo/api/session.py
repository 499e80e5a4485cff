"""The session a socket configures with `session.update`, in the Realtime API's current shape or the
beta's; every field and what becomes of it: docs/realtime.md § Session."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..call_settings import DEFAULT_VOICE, SamplingParams
from ..errors import CallerError, PersonaTooLongError
from ..frame import SAMPLE_RATE
from . import errors as e
from .client_events import typed
from .errors import RealtimeError
from .speech_detector import SpeechConfig

# Sampling settings a session may set under "personaplex" (the same as the page's).
SAMPLING_FIELDS = {"text_temperature": float, "text_top_k": int, "audio_temperature": float, "audio_top_k": int,
                   "seed": int, "greedy": bool}
# Fields of the Realtime API this model has no counterpart for: accepted, ignored, named back.
IGNORED = ("input_audio_transcription", "input_audio_noise_reduction", "tools", "tool_choice",
           "max_response_output_tokens", "max_output_tokens", "tracing", "truncation", "include", "prompt",
           "speed", "client_secret", "expires_at")
# OpenAI's own voices, which agent frameworks send by default (LiveKit "marin", pipecat "alloy"):
# ignored (the session keeps its PersonaPlex voice) rather than refused, so such a session starts.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                           "verse", "marin", "cedar"})


class Dialect(enum.Enum):
    """The event names a client reads: the current API's, or the beta's (`OpenAI-Beta: realtime=v1`)."""

    CURRENT = "current"
    BETA = "beta"


class PromptRules(Protocol):
    """What the door checks a request against before it asks the room (the engine's facts)."""

    voice_names: list[str]
    max_persona_tokens: int

    def persona_tokens(self, persona: str) -> list[int]: ...


@dataclass(frozen=True)
class SessionSettings:
    voice: str = DEFAULT_VOICE
    persona: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    room_events: bool = False  # personaplex.* events (queue, live, ended): clients that know them opt in
    ignored: tuple[str, ...] = ()  # fields the last update set that this model does not use
    locked: tuple[str, ...] = ()  # fields the last update would have changed after the call started
    speech_events: bool = True  # input_audio_buffer.speech_started / stopped (turn_detection not null)

    def call_fields(self) -> tuple[str, str, SamplingParams]:
        return self.voice, self.persona, self.sampling


def _check_audio(session: dict[str, Any], audio_in: dict[str, Any], audio_out: dict[str, Any],
                 event_id: str | None) -> None:
    """Only 16-bit PCM at 24 kHz (the model's own rate, so nothing is resampled on the way), and
    "audio" among the output modalities."""
    formats = {"input_audio_format": session.get("input_audio_format"),
               "output_audio_format": session.get("output_audio_format"),
               "audio.input.format": audio_in.get("format"), "audio.output.format": audio_out.get("format")}
    for where, fmt in formats.items():
        # None (unchanged), the beta shape, or the current one: {"type": "audio/pcm", "rate": 24000}
        if not (fmt is None or fmt == "pcm16" or isinstance(fmt, dict) and fmt.get("type", "audio/pcm") == "audio/pcm"
                and fmt.get("rate", SAMPLE_RATE) == SAMPLE_RATE):
            raise RealtimeError(e.UNSUPPORTED_AUDIO_FORMAT, f"{where} {fmt!r} is not supported: this server takes and "
                                f"sends 16-bit PCM, 24 kHz mono only (\"pcm16\", or {{\"type\": \"audio/pcm\", \"rate\": "
                                f"{SAMPLE_RATE}}}); G.711 and other rates are refused", param=f"session.{where}",
                                event_id=event_id)
    for where in ("modalities", "output_modalities"):
        value = session.get(where)
        if value is not None and (not isinstance(value, list) or "audio" not in value):
            raise RealtimeError(e.UNSUPPORTED_MODALITIES, f"session.{where} {value!r}: this model always speaks, so "
                                "\"audio\" must be among them (its transcript comes with the audio)",
                                param=f"session.{where}", event_id=event_id)


def apply_update(current: SessionSettings, session: Any, rules: PromptRules, *, started: bool,
                 event_id: str | None = None) -> SessionSettings:
    """The settings after one `session.update`, or RealtimeError (nothing applied). `started`: the
    call holds its slot, so voice, persona and sampling keep their values, named in `locked` (no
    error: agent frameworks treat every error as fatal)."""
    if not isinstance(session, dict):
        raise RealtimeError(e.INVALID_FIELD, "session.update needs a \"session\" object", param="session",
                            event_id=event_id)
    audio = _object(session, "audio", "session.audio", event_id)
    audio_in = _object(audio, "input", "session.audio.input", event_id)
    audio_out = _object(audio, "output", "session.audio.output", event_id)
    _check_audio(session, audio_in, audio_out, event_id)
    voice, persona, _ = current.call_fields()
    given_voice = audio_out.get("voice", session.get("voice"))
    ignored_voice = isinstance(given_voice, str) and given_voice in OPENAI_VOICES
    if given_voice is not None and not ignored_voice:
        voice = typed(given_voice, str, "session.voice", event_id)
        if voice not in rules.voice_names:
            raise RealtimeError(e.UNKNOWN_VOICE, f"unknown voice {voice!r}; choose one of "
                                f"{', '.join(rules.voice_names)}", param="session.voice", event_id=event_id)
    if session.get("instructions") is not None:
        persona = typed(session["instructions"], str, "session.instructions", event_id)
        check_persona(persona, rules, "the instructions (the persona)", "session.instructions", event_id)
    sampling, room_events = _our_fields(current, session, event_id)
    locked: tuple[str, ...] = ()
    if started:
        locked = tuple(name for name, now, was in zip(("voice", "instructions", "sampling"),
                                                      (voice, persona, sampling), current.call_fields()) if now != was)
        voice, persona, sampling = current.call_fields()
    ignored = tuple(name for name in IGNORED if session.get(name) not in (None, [], "")
                    or audio_in.get(name.removeprefix("input_audio_")) not in (None, [], "")
                    or audio_out.get(name) not in (None, [], ""))
    speech_events = current.speech_events
    for where in (session, audio_in):  # the beta shape's turn_detection, or the current one's
        if "turn_detection" in where:
            speech_events = where["turn_detection"] is not None
    return SessionSettings(voice, persona, sampling, room_events, ignored + (("voice",) if ignored_voice else ()),
                           locked, speech_events)


def check_persona(persona: str, rules: PromptRules, name: str, param: str, event_id: str | None = None) -> None:
    """RealtimeError unless `persona` can be played into a slot: too long, or text the tokenizer
    refuses (a lone surrogate, say). `name` is what the client called it."""
    try:
        rules.persona_tokens(persona)
    except PersonaTooLongError as exc:
        raise RealtimeError(e.PERSONA_TOO_LONG, f"{name} is too long: {exc}", param=param,
                            event_id=event_id) from None
    except (CallerError, ValueError, UnicodeError) as exc:
        raise RealtimeError(e.INVALID_FIELD, f"{name} cannot be used: {exc}", param=param, event_id=event_id) from None


def _object(parent: dict[str, Any], name: str, where: str, event_id: str | None) -> dict[str, Any]:
    """`parent[name]` when it is an object, {} when absent; invalid_field otherwise."""
    value = parent.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(e.INVALID_FIELD, f"{where} must be an object, got {type(value).__name__}",
                            param=where, event_id=event_id)
    return value


def _our_fields(current: SessionSettings, session: dict[str, Any],
                event_id: str | None) -> tuple[SamplingParams, bool]:
    """The sampling settings and `room_events` after an update: the beta `temperature` and the
    "personaplex" extension object."""
    sampling = current.sampling
    knobs: dict[str, Any] = {}
    if session.get("temperature") is not None:  # the beta session's one temperature: the voice's
        knobs["audio_temperature"] = typed(session["temperature"], float, "session.temperature", event_id)
    ours = _object(session, "personaplex", "session.personaplex", event_id)
    room_events = current.room_events
    for name, value in ours.items():
        if name == "room_events":
            room_events = typed(value, bool, "session.personaplex.room_events", event_id)
        elif name in SAMPLING_FIELDS:
            knobs[name] = None if value is None and name == "seed" else typed(
                value, SAMPLING_FIELDS[name], f"session.personaplex.{name}", event_id)
        else:
            raise RealtimeError(e.INVALID_FIELD, f"unknown field session.personaplex.{name}; known: room_events, "
                                f"{', '.join(SAMPLING_FIELDS)}", param=f"session.personaplex.{name}",
                                event_id=event_id)
    if knobs:
        sampling = dataclasses.replace(sampling, **knobs)
        if any(isinstance(v, float) and not math.isfinite(v) for v in knobs.values()):
            raise RealtimeError(e.INVALID_SAMPLING, "sampling settings must be finite numbers",
                                param="session.personaplex", event_id=event_id)
        try:
            sampling.validate()
        except ValueError as exc:
            raise RealtimeError(e.INVALID_SAMPLING, str(exc), param="session.personaplex",
                                event_id=event_id) from None
    return sampling, room_events


def session_object(settings: SessionSettings, dialect: Dialect, session_id: str, model: str) -> dict[str, Any]:
    """The session as `session.created` and `session.updated` show it, in the client's dialect."""
    ours = {"room_events": settings.room_events, **dataclasses.asdict(settings.sampling),
            "ignored": list(settings.ignored), "locked": list(settings.locked)}
    pcm = {"type": "audio/pcm", "rate": SAMPLE_RATE}
    turns = turn_detection(settings)
    if dialect is Dialect.BETA:
        return {"id": session_id, "object": "realtime.session", "model": model, "modalities": ["audio", "text"],
                "instructions": settings.persona, "voice": settings.voice, "input_audio_format": "pcm16",
                "output_audio_format": "pcm16", "input_audio_transcription": None, "turn_detection": turns,
                "tools": [], "tool_choice": "none", "temperature": settings.sampling.audio_temperature,
                "max_response_output_tokens": "inf", "personaplex": ours}
    return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": ["audio"], "instructions": settings.persona,
            "audio": {"input": {"format": pcm, "transcription": None, "turn_detection": turns,
                                "noise_reduction": None},
                      "output": {"format": pcm, "voice": settings.voice, "speed": 1.0}},
            "tools": [], "tool_choice": "none", "max_output_tokens": "inf", "personaplex": ours}


def turn_detection(settings: SessionSettings) -> dict[str, Any] | None:
    """As the Realtime API describes server VAD: the speech events come from api/speech_detector.py,
    and the model itself answers and yields (responses are created and interrupted without a request)."""
    if not settings.speech_events:
        return None
    vad = SpeechConfig()
    return {"type": "server_vad", "threshold": vad.threshold, "prefix_padding_ms": vad.padding_ms,
            "silence_duration_ms": vad.silence_ms, "idle_timeout_ms": None, "create_response": True,
            "interrupt_response": True}


def join_persona(persona: str, *texts: str) -> str:
    """The persona with more instruction text after it, a line each (the model's only text input is its prompt)."""
    return "\n".join(part.strip() for part in (persona, *texts) if part.strip())
