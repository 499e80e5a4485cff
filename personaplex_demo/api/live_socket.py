"""One GPT-Live WebSocket (`/v1/live/sessions`): `session.start` places the call, the client's audio
streams in, and every agent frame streams out as it is made. What pipecat's and LiveKit's clients
need of it, and why (`session.started` at once, non-speech frames as exact zeros, text only with
audible audio, no `error` for what is merely unsupported): docs/realtime.md § GPT-Live.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from starlette.websockets import WebSocket

from ..frame import FRAME_SECONDS
from ..serving.room import CallHandle, Room, SlotOutput
from . import errors as e
from .client_events import ClientEvent, field
from .config import ApiConfig
from .errors import RealtimeError
from .live_events import KNOWN, TEXT_APPENDS, answer, error_event, session_resource, start_settings
from .server_events import event, pcm16_base64
from .session import PromptRules, SessionSettings
from .socket_base import ApiSocket
from .socket_door import SocketDoor
from .stats import DoorStats
from .turns import is_speech

log = logging.getLogger(__name__)

USAGE_EVERY_FRAMES = 12  # session.usage.updated about once a second
HOLD_TEXT_FRAMES = 12  # a transcript piece waits this long for audible audio, then is left out


class LiveDoor(SocketDoor):
    kind, path, label = "live", "/v1/live/sessions", "GPT-Live"

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        return "gpt-live", LiveSocket(ws, self.doors.room, self.doors.rules, self.config, self.stats)


class LiveSocket(ApiSocket):
    protocol = "gpt-live"
    start_hint = "send session.start to start one"
    known, unsupported = KNOWN, {}

    def __init__(self, ws: WebSocket, room: Room, rules: PromptRules, config: ApiConfig, stats: DoorStats) -> None:
        super().__init__(ws, room, config, stats, LiveDoor.kind, speech=False)
        self.rules = rules
        self.settings: SessionSettings | None = None
        self._held_text: list[str] = []
        self._held_since = 0

    def error_event(self, err: RealtimeError) -> dict[str, Any]:
        return error_event(err)

    def _resource(self, status: str = "active") -> dict[str, Any]:
        assert self.settings is not None
        return session_resource(self.settings, self.session_id, self.config.model_name, status)

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
        if await self.runner.start(*settings.call_fields(), ev.event_id):
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
        self.room_event("call_ended", reason=reason, message=message)
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
