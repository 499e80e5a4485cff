"""What every API socket does, whatever protocol it speaks: client events in, one call in the room,
server events out, on the server's event loop. The call is released when the socket closes for any
reason, so a slot never outlives its socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.websockets import WebSocket

from ..call_settings import SamplingParams
from ..errors import PersonaTooLongError, UnknownVoiceError
from ..serving.door import DoorCall, Ended, Frame, Live, Preparing, Queued, Refusal, RefusalKind
from ..serving.room import CallHandle, EndReason, Room, SlotOutput, end_message
from . import errors as e
from .client_events import KNOWN, UNSUPPORTED, ClientEvent, parse
from .config import ApiConfig
from .errors import RealtimeError
from .feeder import Feeder
from .outbox import Outbox
from .server_events import error_event, event, new_id
from .speech_detector import SpeechConfig, SpeechEvents
from .stats import DoorStats

log = logging.getLogger(__name__)

CLOSE_SECONDS = 2.0  # for the last events to leave and the close handshake, before giving up on a client

# The WebSocket close code a call's end comes with (the words are the room's: serving/room.py).
CLOSE_CODES = {EndReason.TIME_LIMIT: 1000, EndReason.IDLE: 1000, EndReason.QUEUE_TIMEOUT: 1013,
               EndReason.OVERLOADED: 1013, EndReason.SHUTDOWN: 1001, EndReason.NOT_READING: 1008}
# The close codes of bad input (RFC 6455): data of a kind not taken, data that cannot be read, a
# request or pace refused.
UNSUPPORTED_DATA, INVALID_DATA, POLICY = 1003, 1007, 1008


class Refused(Exception):
    """Bad input that ends the call: the socket is closed with `code` (see `ApiSocket.refuse`)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class ApiSocket:
    """The door's side of one accepted socket; `run` returns when it has closed. By default its
    events are JSON, read and written as the Realtime API's."""

    protocol = "api"  # for the log
    start_hint = "send an event that starts one"  # what a client that starts no call should do
    known: tuple[str, ...] = KNOWN  # the client events taken, and those refused with a reason
    unsupported: dict[str, str] = UNSUPPORTED

    def __init__(self, ws: WebSocket, room: Room, config: ApiConfig, stats: DoorStats, door: str,
                 speech: bool = True) -> None:
        self.ws, self.config, self.stats = ws, config, stats
        self.session_id = new_id("sess")
        self.runner = SocketCall(self, room, door, config.speech if speech else SpeechConfig(enabled=False))
        self.door_call, self.feeder = self.runner.door_call, self.runner.feeder
        self.outbox = Outbox()
        self.room_events = False  # personaplex.* events (queue, live, ended): clients that know them opt in
        self.closing = False
        self.frames_out = 0
        self._tasks: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None

    @property
    def call(self) -> CallHandle | None:
        return self.door_call.call

    # ---- what a protocol says ------------------------------------------------------------------

    def opened(self) -> None:
        """The socket was accepted: the first events, if the protocol sends any."""

    def parse(self, text: str | bytes | None) -> ClientEvent:
        """One message as a client event (RealtimeError: sent back; Refused: the socket closed)."""
        return parse(text, self.config.max_message_bytes, self.known, self.unsupported)

    async def handle(self, ev: ClientEvent) -> None:
        raise NotImplementedError

    def error_event(self, err: RealtimeError) -> dict[str, Any] | bytes | None:
        """The protocol's error message (None: it has none, the error is counted and logged only)."""
        return error_event(err)

    def on_live(self, call: CallHandle) -> None:
        """The call went live: the agent's first frame comes next."""

    def on_frame(self, out: SlotOutput) -> None:
        raise NotImplementedError

    def on_speech(self, kind: str, ms: int) -> None:
        """The caller started ("started") or stopped ("stopped") speaking, `ms` into the audio heard."""

    async def on_ended(self, reason: str) -> None:
        """The room ended the call (or the caller hung up): say so and close with the end's code and words."""
        if reason == EndReason.HANGUP:
            await self.close(1000, "hang-up")
            return
        message = end_message(reason)
        self.tell_ended(reason, message)
        await self.close(CLOSE_CODES.get(reason, 1011), message)

    def tell_ended(self, reason: str, message: str) -> None:
        """Room news to a client that asked for it, else an `error` with code call_ended."""
        if self.room_events:
            self.room_event("call_ended", reason=reason, message=message)
        else:
            self.error(RealtimeError(e.CALL_ENDED, f"the call ended ({reason}): {message}", kind="server_error"))

    # ---- the socket's life ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the socket until it closes (the door counts it open and closed)."""
        self.opened()
        self.spawn(self._write())
        self.spawn(self._expect_a_call())
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait({self._reader})
        finally:
            self.runner.release()
            for task in [self._reader, *self._tasks]:
                task.cancel()
            log.info("%s %s closed: %d frames in, %d out", self.protocol, self.session_id, self.feeder.frames_in,
                     self.frames_out)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                await self.handle(self.parse(message.get("text", message.get("bytes"))))
            except Refused as refused:
                await self.refuse(refused.code, refused.reason)
            except RealtimeError as err:
                self.error(err)
            except Exception:  # a bug here must not cost the caller the call: say so and go on
                log.exception("%s %s: handling an event failed", self.protocol, self.session_id)
                self.error(RealtimeError(e.INTERNAL_ERROR, "the server failed on this event; it was dropped",
                                         kind="server_error"))

    async def _write(self) -> None:
        try:
            while True:
                message, audio = await self.outbox.get()
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_text(message)
                self.outbox.sent(audio)
        except Exception as exc:  # the client is gone: stop reading too
            log.info("%s %s: sending failed (%s); closing", self.protocol, self.session_id, type(exc).__name__)
            if self._reader is not None:
                self._reader.cancel()

    async def _expect_a_call(self) -> None:
        """An open socket holds a place in its client's socket limit: one that starts no call is closed."""
        await asyncio.sleep(self.config.start_timeout_seconds)
        if self.call is None:
            self.error(RealtimeError(e.NO_SESSION, f"no call was started within {self.config.start_timeout_seconds:g}"
                                     f" s of connecting; {self.start_hint}", kind="server_error"))
            await self.close(1000, "no call was started")

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued (briefly), close the socket, stop reading."""
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.outbox.drained(), CLOSE_SECONDS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, reason[:120]), CLOSE_SECONDS)
        if self._reader is not None:
            self._reader.cancel()

    def send(self, ev: dict[str, Any] | str | bytes, audio: bool = False) -> None:
        if not self.closing:
            self.outbox.put(ev, audio)

    def send_all(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.send(ev)

    async def refuse(self, code: int, reason: str) -> None:
        """Bad input that ends the call: counted, said as the protocol's error, the call hung up and
        the socket closed with `code` and the reason, never disturbing another call."""
        self.stats.error(str(code))
        log.info("%s %s: closing (%d): %s", self.protocol, self.session_id, code, reason)
        if (message := self.error_event(RealtimeError(str(code), reason))) is not None:
            self.send(message)
        self.door_call.hang_up()
        await self.close(code, reason)

    async def start_checked(self, voice: str, persona: str, sampling: SamplingParams) -> None:
        """Start a call the door checked already; the room refusing it all the same closes the socket."""
        try:
            await self.runner.start(voice, persona, sampling, None)
        except RealtimeError as err:
            await self.refuse(POLICY, err.message)

    def error(self, err: RealtimeError) -> None:
        self.stats.error(err.code)
        log.info("%s %s: %s", self.protocol, self.session_id, err)
        if (message := self.error_event(err)) is not None:
            self.send(message)

    def room_event(self, kind: str, **fields: Any) -> None:
        if self.room_events:
            self.send(event(f"personaplex.{kind}", **fields))

    def spawn(self, coro) -> asyncio.Task:
        """A task of this socket's, cancelled when it closes."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class SocketCall:
    """The call behind one API socket: placed in the room, its wait told (room events), then the
    agent's frames handed to the socket's protocol and the client's audio fed at the room's pace."""

    def __init__(self, socket: ApiSocket, room: Room, door: str, speech: SpeechConfig) -> None:
        self.socket = socket
        self.door_call = DoorCall(room, door)
        self.speech = SpeechEvents(speech, socket.on_speech)  # hears each frame the feeder hands the room
        self.feeder = Feeder(socket.config, self.door_call, self.speech.hear)

    def release(self) -> None:
        """The socket closed: the call goes with it (a call that ended keeps its reason)."""
        self.door_call.hang_up()
        self.speech.close()

    async def start(self, voice: str, persona: str, sampling: SamplingParams, event_id: str | None) -> bool:
        """Ask the room for the call; True once it holds one (seated or queued). A refusal is the
        client's error: raised for a bad request, sent (and the socket closed) otherwise."""
        socket = self.socket
        refusal = await self.door_call.start(voice, persona, sampling)
        if refusal is not None:
            await self._refused(refusal, event_id)
            return False
        call = self.door_call.call
        if socket.closing:  # the socket went while the room placed the call
            self.door_call.hang_up()
            return False
        log.info("%s %s: call %s (%s), voice %s, persona %r", socket.protocol, socket.session_id, call.id, call.state,
                 voice, persona if len(persona) <= 200 else persona[:200] + "…")
        socket.spawn(self._run(call))
        return True

    async def _refused(self, refusal: Refusal, event_id: str | None) -> None:
        exc = refusal.error
        if refusal.kind == RefusalKind.CALLER:
            code = (e.UNKNOWN_VOICE if isinstance(exc, UnknownVoiceError) else
                    e.PERSONA_TOO_LONG if isinstance(exc, PersonaTooLongError) else e.INVALID_FIELD)
            raise RealtimeError(code, str(exc), param="session", event_id=event_id)
        if refusal.kind == RefusalKind.FULL:
            self.socket.error(RealtimeError(e.ROOM_FULL, f"the room is full and its queue too ({exc}); try again in "
                                            "a minute", event_id=event_id, kind="server_error"))
            await self.socket.close(1013, "the room is full")
        else:
            self.socket.error(RealtimeError(e.ROOM_CLOSED, f"the room is not taking calls: {exc}", event_id=event_id,
                                            kind="server_error"))
            await self.socket.close(1001, "the room is closed")

    async def _run(self, call: CallHandle) -> None:
        socket = self.socket
        try:
            event = await self._wait_for_live()
            if event is None:
                return
            socket.room_event("live", call_id=call.id, time_left=call.time_left())
            socket.on_live(call)
            self.feeder.live()
            self.feeder.feed()
            while True:
                match event if isinstance(event, Frame) else await self.door_call.next_event(0.25):
                    case Frame(out=out):
                        self.feeder.answered()
                        socket.frames_out += 1
                        socket.on_frame(out)
                    case Ended(reason=reason):
                        await socket.on_ended(reason)
                        return
                event = None
                self.feeder.feed()
                if socket.outbox.client_stopped_reading(socket.ws.scope, socket.config.send_backlog_seconds):
                    log.warning("%s %s: the client stopped reading; closing", socket.protocol, socket.session_id)
                    self.door_call.hang_up(EndReason.NOT_READING)
                    socket.stats.error("client_not_reading")
                    await socket.close(1008, "the client stopped reading its audio")
                    return
        except Exception as exc:
            log.exception("%s %s: the call's runner failed", socket.protocol, socket.session_id)
            self.door_call.hang_up(EndReason.error(f"{socket.protocol} door: {type(exc).__name__}"))
            await socket.close(1011, "the server failed on this call")

    async def _wait_for_live(self) -> Live | Frame | None:
        """Tell the client its place in the queue and when it is being prepared, until the call is
        live (a frame before the news of it counts: the call went live and ended at once); None
        when it ended first."""
        while True:
            match event := await self.door_call.next_event(1.0):
                case Queued(position=position, reason=reason):
                    self.socket.room_event("queue", position=position, reason=reason)
                case Preparing():
                    self.socket.room_event("preparing")
                case Live() | Frame():
                    return event
                case Ended(reason=reason):
                    await self.socket.on_ended(reason)
                    return None
