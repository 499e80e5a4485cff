"""One GPT-Live WebSocket (`/v1/live/sessions`): `session.start` places the call, then audio streams
both ways. What pipecat's and LiveKit's clients need of it, and why: docs/realtime.md § GPT-Live.
`session.start` is read through the Realtime door's rules, so both doors judge a voice, a persona or a
format alike."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
from starlette.websockets import WebSocket

from ..frame import FRAME_SECONDS, SAMPLE_RATE
from ..serving.room import CallHandle, SlotOutput
from . import errors as e
from .client_events import ClientEvent, field, typed
from .conversation import is_speech
from .errors import RealtimeError
from .server_events import event, pcm16_base64
from .session import PromptRules, SessionSettings, apply_update, join_persona
from .socket_base import ApiSocket, SocketDoor

log = logging.getLogger(__name__)

USAGE_EVERY_FRAMES = 12  # session.usage.updated about once a second
HOLD_TEXT_FRAMES = 12  # a transcript piece waits this long for audible audio, then is left out
# The client events the door takes; what each does: docs/realtime.md § GPT-Live.
KNOWN = ("session.start", "session.update", "session.input_audio.append", "session.input_audio.mute",
         "session.input_audio.unmute", "session.commentary.append", "session.thinking.append",
         "session.instructions.append", "response.item.create", "response.create", "session.close")
TEXT_APPENDS = {"session.commentary.append": "session.commentary.appended",
                "session.thinking.append": "session.thinking.appended",
                "session.instructions.append": "session.instructions.appended"}
# What a session.start may hold that this model has no use for: accepted, ignored, named back.
IGNORED = ("model", "delegation", "store", "tools", "tool_choice", "context_management")
PERSONA_ROLES = ("system", "developer")  # `input` messages that become part of the persona


def _input_texts(items: Any, event_id: str | None) -> tuple[list[str], int]:
    """The text of the `input` messages that join the persona, and how many others were ignored
    (the model hears no text turns: user and assistant messages cannot be played into it)."""
    if items is None:
        return [], 0
    if not isinstance(items, list):
        raise RealtimeError(e.INVALID_FIELD, "session.input must be a list of messages", param="session.input",
                            event_id=event_id)
    texts, ignored = [], 0
    for item in items:
        if not isinstance(item, dict) or item.get("role") not in PERSONA_ROLES:
            ignored += 1
            continue
        content = item.get("content")
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        texts += [part if isinstance(part, str) else str(part.get("text", "")) for part in parts
                  if isinstance(part, str) or (isinstance(part, dict) and isinstance(part.get("text"), str))]
    return [text for text in texts if text.strip()], ignored


def start_settings(session: Any, rules: PromptRules, event_id: str | None) -> SessionSettings:
    """The call's settings from a `session.start`'s session object, or RealtimeError."""
    if not isinstance(session, dict):
        raise RealtimeError(e.MISSING_FIELD, "session.start needs a \"session\" object", param="session",
                            event_id=event_id)
    audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
    audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
    voice = audio_out.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice
    texts, ignored_input = _input_texts(session.get("input"), event_id)
    instructions = session.get("instructions")
    if texts:
        base = typed(instructions, str, "session.instructions", event_id) if instructions is not None else ""
        instructions = join_persona(base, *texts)
    # The Realtime API's (current) session shape, read by the same rules.
    realtime = {"instructions": instructions, "personaplex": session.get("personaplex"),
                "audio": {"input": {"format": audio.get("format")},
                          "output": {"format": audio.get("format"), "voice": voice}}}
    settings = apply_update(SessionSettings(), realtime, rules, started=False, event_id=event_id)
    ignored = tuple(name for name in IGNORED if session.get(name) not in (None, [], "", {}))
    return dataclasses.replace(settings, ignored=settings.ignored + ignored + (("input",) if ignored_input else ()))


def answer(kind: str, ev: ClientEvent, **fields: Any) -> dict[str, Any]:
    """A server event that answers client event `ev` (its id echoed as `client_event_id`)."""
    return event(kind, client_event_id=ev.event_id, **fields)


class LiveDoor(SocketDoor):
    kind, path, label = "live", "/v1/live/sessions", "GPT-Live"

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        return "gpt-live", LiveSocket(ws, self)


class LiveSocket(ApiSocket):
    protocol = "gpt-live"
    start_hint = "send session.start to start one"
    known, unsupported = KNOWN, {}

    def __init__(self, ws: WebSocket, door: SocketDoor) -> None:
        super().__init__(ws, door)
        self.settings: SessionSettings | None = None
        self._held_text: list[str] = []
        self._held_since = 0

    def error_event(self, err: RealtimeError) -> dict[str, Any]:
        return event("error", client_event_id=err.event_id, error=err.as_error("client_event_id"))

    def _resource(self, status: str = "active") -> dict[str, Any]:
        """The session as `session.started`, `session.updated` and `session.closed` show it."""
        settings = self.settings
        assert settings is not None
        return {"id": self.session_id, "object": "live.session", "status": status, "model": self.config.model_name,
                "instructions": settings.persona,
                "audio": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}, "output": {"voice": settings.voice}},
                "delegation": None, "personaplex": {"ignored": list(settings.ignored),
                                                    "room_events": settings.room_events}}

    async def handle(self, ev: ClientEvent) -> None:
        if ev.type == "session.start":
            await self._start(ev)
            return
        if self.settings is None:
            raise RealtimeError(e.SESSION_NOT_STARTED, f"{ev.type} needs a session: send session.start first",
                                param="type", event_id=ev.event_id)
        match ev.type:
            case "session.input_audio.append":
                self.feeder.append(field(ev, "audio", str), ev.event_id)
            case "session.input_audio.mute" | "session.input_audio.unmute":
                self.feeder.muted = ev.type.endswith(".mute")
                self.send(answer("session.input_audio.muted" if self.feeder.muted else "session.input_audio.unmuted",
                                 ev))
            case kind if kind in TEXT_APPENDS:
                # The model's only text is its persona, played in before the call: text later is
                # taken and not heard (docs/realtime.md § GPT-Live).
                field(ev, "content", str)
                now = round(self.frames_out * FRAME_SECONDS * 1000)
                log.info("gpt-live %s: %s taken, not heard (the model takes text only as its persona)",
                         self.session_id, kind)
                self.send(answer(TEXT_APPENDS[kind], ev, start_ms=now, end_ms=now))
            case "session.update":
                # Only delegation settings may change after the start, and this model delegates nothing.
                self.send(answer("session.updated", ev, session=self._resource()))
            case "response.item.create" | "response.create":
                log.info("gpt-live %s: %s taken and ignored (no delegation here)", self.session_id, ev.type)
            case "session.close":
                await self._close_requested(ev)

    async def _start(self, ev: ClientEvent) -> None:
        if self.settings is not None:
            raise RealtimeError(e.SESSION_ALREADY_STARTED, "this socket's session has started; open another "
                                "socket for another session", param="type", event_id=ev.event_id)
        settings = start_settings(ev.body.get("session"), self.rules, ev.event_id)
        self.room_events = settings.room_events
        if await self.start_call(*settings.call_fields(), ev.event_id):
            self.settings = settings
            self.send(answer("session.started", ev, session=self._resource()))

    def on_frame(self, out: SlotOutput) -> None:
        speech = is_speech(out.pcm, "", self.config.speech_dbfs)
        ms = round((self.frames_out - 1) * FRAME_SECONDS * 1000)
        self.send(event("session.output_audio.delta", delta=pcm16_base64(out.pcm if speech else np.zeros_like(out.pcm))))
        if out.text:
            if not self._held_text:
                self._held_since = self.frames_out
            self._held_text.append(out.text)
        if self._held_text and speech:
            self.send(event("session.output_transcript.delta", delta="".join(self._held_text), start_ms=ms,
                            end_ms=ms + round(FRAME_SECONDS * 1000)))
            self._held_text = []
        elif self._held_text and self.frames_out - self._held_since >= HOLD_TEXT_FRAMES:
            log.debug("gpt-live %s: %r had no audible audio; left out of the transcript", self.session_id,
                      "".join(self._held_text))
            self._held_text = []
        if self.frames_out % USAGE_EVERY_FRAMES == 0:
            self.send(event("session.usage.updated", usage={"seconds": round(self.frames_out * FRAME_SECONDS, 3)}))

    def tell_ended(self, reason: str, message: str) -> None:
        self.send(event("session.closed", **self._closed_fields(reason, message)))

    async def _close_requested(self, ev: ClientEvent) -> None:
        """`session.close`: the call ends, `session.closed` answers at once, then the close."""
        self.door_call.hang_up()
        self.send(answer("session.closed", ev, **self._closed_fields("close_requested", "closed by the client")))
        await self.close(1000, "closed by the client")

    def _closed_fields(self, reason: str, message: str) -> dict[str, Any]:
        """What `session.closed` says: why (the client's close, or the room's end of the call), the usage."""
        fields = {"reason": reason, "message": message, "usage": {"seconds": round(self.frames_out * FRAME_SECONDS, 3)}}
        if self.settings is not None:
            fields["session"] = self._resource("closed")
        return fields

    def on_live(self, call: CallHandle) -> None:
        log.info("gpt-live %s: call %s live", self.session_id, call.id)
