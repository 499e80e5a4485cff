"""One Realtime WebSocket: client events in, a call in the room, server events out
(docs/realtime.md). Three tasks share the socket, all on the server's event loop, none blocking it:

- the reader takes client events one at a time and answers each (or sends an `error`);
- the call's runner waits for a slot (telling the client its place when it asked for room
  events), then reads the agent's frames, turns them into responses (api/turns.py) and hands the
  room the client's audio at the room's own pace (`_feed`);
- the writer sends what the other two queued, and a client that stops reading is disconnected
  once `send_backlog_seconds` of audio wait for it.

The call is released when the socket closes for any reason, so a slot never outlives its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.websockets import WebSocket

from ..errors import PersonaTooLongError, UnknownVoiceError
from ..serving.door import DoorCall, Ended, Frame, Live, Preparing, Queued, Refusal, RefusalKind
from ..serving.room import (
    DOOR_REALTIME,
    CallHandle,
    EndReason,
    Room,
    end_message,
)
from . import errors as e
from .audio_in import decode_pcm16
from .client_events import ClientEvent, field, parse
from .config import RealtimeConfig
from .errors import RealtimeError
from .feeder import Feeder
from .outbox import Outbox
from .server_events import error_event, event
from .session import Dialect, PromptRules, SessionSettings, apply_update, new_id, session_object
from .stats import DoorStats
from .turns import TurnTracker

log = logging.getLogger(__name__)

CLOSE_SECONDS = 2.0  # for the last events to leave and the close handshake, before giving up on a client

# The WebSocket close code a call's end comes with (the words are the room's: serving/room.py).
CLOSE_CODES = {EndReason.TIME_LIMIT: 1000, EndReason.IDLE: 1000, EndReason.QUEUE_TIMEOUT: 1013,
               EndReason.OVERLOADED: 1013, EndReason.SHUTDOWN: 1001, EndReason.NOT_READING: 1008}


class RealtimeSocket:
    """The door's side of one accepted socket; `run` returns when it has closed."""

    def __init__(self, ws: WebSocket, room: Room, rules: PromptRules, config: RealtimeConfig, dialect: Dialect,
                 stats: DoorStats) -> None:
        self.ws, self.room, self.rules, self.config, self.dialect, self.stats = ws, room, rules, config, dialect, stats
        self.session_id = new_id("sess")
        self.settings = SessionSettings()
        self.door_call = DoorCall(room, DOOR_REALTIME)
        self.feeder = Feeder(config)
        self.turns = TurnTracker(dialect, config.turn_end_seconds, config.speech_dbfs)
        self.outbox = Outbox()
        self.frames_out = 0
        self.update_refused = False  # a session.update was refused and none taken since
        self._tasks: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None
        self._closing = False

    @property
    def call(self) -> CallHandle | None:
        return self.door_call.call

    # ---- the socket's life ---------------------------------------------------------------------

    async def run(self) -> None:
        self.stats.opened()
        self.send(event("session.created", session=self._session()))
        self._spawn(self._write())
        self._spawn(self._expect_a_call())
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait({self._reader})
        finally:
            self.door_call.hang_up()  # idempotent: a call that ended keeps its reason
            for task in [self._reader, *self._tasks]:
                task.cancel()
            self.stats.closed()
            log.info("realtime %s closed: %d frames in, %d out, %d responses", self.session_id, self.feeder.frames_in,
                     self.frames_out, self.turns.responses)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                await self._handle(parse(message.get("text", message.get("bytes")), self.config.max_message_bytes))
            except RealtimeError as err:
                self.error(err)
            except Exception:  # a bug here must not cost the caller the call: say so and go on
                log.exception("realtime %s: handling an event failed", self.session_id)
                self.error(RealtimeError("internal_error", "the server failed on this event; it was dropped",
                                         kind="server_error"))

    async def _write(self) -> None:
        try:
            while True:
                text, audio = await self.outbox.get()
                await self.ws.send_text(text)
                self.outbox.sent(audio)
        except Exception as exc:  # the client is gone: stop reading too
            log.info("realtime %s: sending failed (%s); closing", self.session_id, type(exc).__name__)
            if self._reader is not None:
                self._reader.cancel()

    async def _expect_a_call(self) -> None:
        """A socket that has not started a call within `start_timeout_seconds` is closed: an open
        socket holds a place in its client's socket limit."""
        await asyncio.sleep(self.config.start_timeout_seconds)
        if self.call is None:
            self.error(RealtimeError(e.NO_SESSION, f"no call was started within {self.config.start_timeout_seconds:g}"
                                     " s of connecting; send session.update to start one", kind="server_error"))
            await self.close(1000, "no call was started")

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued (briefly), close the socket, stop reading."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.outbox.drained(), CLOSE_SECONDS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, reason[:120]), CLOSE_SECONDS)
        if self._reader is not None:
            self._reader.cancel()

    def send(self, ev: dict[str, Any]) -> None:
        if not self._closing:
            self.outbox.put(ev)

    def error(self, err: RealtimeError) -> None:
        self.stats.error(err.code)
        log.info("realtime %s: %s", self.session_id, err)
        self.send(error_event(err))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _session(self) -> dict[str, Any]:
        return session_object(self.settings, self.dialect, self.session_id, self.config.model_name)

    # ---- client events -------------------------------------------------------------------------

    async def _handle(self, ev: ClientEvent) -> None:
        match ev.type:
            case "session.update":
                try:
                    self.settings = apply_update(self.settings, field(ev, "session", dict), self.rules,
                                                 started=self.call is not None, event_id=ev.event_id)
                except RealtimeError:
                    self.update_refused = self.call is None
                    raise
                self.update_refused = False
                self.send(event("session.updated", session=self._session()))
                if self.call is None:
                    await self._start_call(ev.event_id)
            case "input_audio_buffer.append":
                audio = field(ev, "audio", str)
                if self.call is None and not self.update_refused:
                    # No session.update at all: the default voice and persona. (After a refused one
                    # the client is still choosing; its audio is not heard yet.) A chunk that is not
                    # PCM16 is refused before a call starts for it.
                    decode_pcm16(audio, ev.event_id)
                    await self._start_call(ev.event_id)
                if self.feeder.append(audio, self.call, ev.event_id):
                    self.feeder.feed(self.call)
            case "input_audio_buffer.clear":
                self.feeder.audio.clear()
                self.send(event("input_audio_buffer.cleared"))
            case "input_audio_buffer.commit":
                # Nothing to commit: the model hears the audio as it comes. Acknowledged for clients
                # that commit at the end of the user's turn.
                self.send(event("input_audio_buffer.committed", previous_item_id=None, item_id=new_id("item")))
            case "response.create":
                if self.call is None and not self.update_refused:
                    await self._start_call(ev.event_id)
                response = ev.body.get("response") if isinstance(ev.body.get("response"), dict) else {}
                opened = self.turns.request(response.get("metadata"))
                if opened is None:
                    raise RealtimeError("conversation_already_has_active_response", "a response is already in "
                                        "progress: the model answers in its own time", event_id=ev.event_id)
                self._send_all(opened)
            case "response.cancel":
                closed = self.turns.cancel()
                if closed is None:
                    raise RealtimeError("response_cancel_not_active", "no response is in progress",
                                        event_id=ev.event_id)
                self._send_all(closed)

    def _send_all(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.send(ev)

    # ---- the call ------------------------------------------------------------------------------

    async def _start_call(self, event_id: str | None) -> None:
        voice, persona, sampling = self.settings.call_fields()
        refusal = await self.door_call.start(voice, persona, sampling)
        if refusal is not None:
            await self._refused(refusal, event_id)
            return
        call = self.door_call.call
        if self._closing:  # the socket went while the room placed the call
            self.door_call.hang_up()
            return
        log.info("realtime %s: call %s (%s), voice %s", self.session_id, call.id, call.state, voice)
        self._spawn(self._run_call(call))

    async def _refused(self, refusal: Refusal, event_id: str | None) -> None:
        """The client's error for a call the room did not take (a bad request is the event's error)."""
        exc = refusal.error
        if refusal.kind == RefusalKind.CALLER:
            code = (e.UNKNOWN_VOICE if isinstance(exc, UnknownVoiceError) else
                    e.PERSONA_TOO_LONG if isinstance(exc, PersonaTooLongError) else e.INVALID_FIELD)
            raise RealtimeError(code, str(exc), param="session", event_id=event_id)
        if refusal.kind == RefusalKind.FULL:
            self.error(RealtimeError(e.ROOM_FULL, f"the room is full and its queue too ({exc}); try again in a "
                                     "minute", event_id=event_id, kind="server_error"))
            await self.close(1013, "the room is full")
        else:
            self.error(RealtimeError(e.ROOM_CLOSED, f"the room is not taking calls: {exc}", event_id=event_id,
                                     kind="server_error"))
            await self.close(1001, "the room is closed")

    def room_event(self, kind: str, **fields: Any) -> None:
        if self.settings.room_events:
            self.send(event(f"personaplex.{kind}", **fields))

    async def _run_call(self, call: CallHandle) -> None:
        try:
            event = await self._wait_for_live()
            if event is None:
                return
            self.room_event("live", call_id=call.id, time_left=call.time_left())
            self.feeder.live()
            self.feeder.feed(call)
            while True:
                match event if isinstance(event, Frame) else await self.door_call.next_event(0.25):
                    case Frame(out=out):
                        self.feeder.answered()
                        self.frames_out += 1
                        self._send_all(self.turns.frame(out.pcm, out.text))
                    case Ended(reason=reason):
                        await self._ended(reason)
                        return
                event = None
                self.feeder.feed(call)
                if self.outbox.client_stopped_reading(self.ws.scope, self.config.send_backlog_seconds):
                    log.warning("realtime %s: the client stopped reading; closing", self.session_id)
                    self.door_call.hang_up(EndReason.NOT_READING)
                    self.stats.error("client_not_reading")
                    await self.close(1008, "the client stopped reading its audio")
                    return
        except Exception as exc:
            log.exception("realtime %s: the call's runner failed", self.session_id)
            self.door_call.hang_up(EndReason.error(f"realtime door: {type(exc).__name__}"))
            await self.close(1011, "the server failed on this call")

    async def _wait_for_live(self) -> Live | Frame | None:
        """Tell the client (with room events on) its place in the queue and when it is being
        prepared, until the call is live (a frame before the news of it counts: the call went
        live and ended at once); None when it ended first."""
        while True:
            match event := await self.door_call.next_event(1.0):
                case Queued(position=position, reason=reason):
                    self.room_event("queue", position=position, reason=reason)
                case Preparing():
                    self.room_event("preparing")
                case Live() | Frame():
                    return event
                case Ended(reason=reason):
                    await self._ended(reason)
                    return None

    async def _ended(self, reason: str) -> None:
        self._send_all(self.turns.finish(reason))
        if reason == EndReason.HANGUP:
            await self.close(1000, "hang-up")
            return
        code, message = CLOSE_CODES.get(reason, 1011), end_message(reason)
        if self.settings.room_events:
            self.room_event("call_ended", reason=reason, message=message)
        else:
            self.error(RealtimeError(e.CALL_ENDED, f"the call ended ({reason}): {message}", kind="server_error"))
        await self.close(code, message)
