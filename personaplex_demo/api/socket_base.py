"""The door base: what the table of doors (api/doors.py) knows of one door (`SocketDoor`, with the key its
client presents and its counts), and what every API socket does, whatever protocol it speaks (`ApiSocket`,
on its `Wire`): client events in, one call in the room, server events out, on the server's event loop.
The call is released when the socket closes for any reason, so a slot never outlives its socket."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute
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
from .server_events import event
from .session import PromptRules
from .speech_detector import SpeechConfig, SpeechEvents
from .wire import Wire

log = logging.getLogger(__name__)

# Browsers cannot set headers on a WebSocket; they pass the key as a subprotocol instead.
KEY_SUBPROTOCOL = "openai-insecure-api-key."
# The WebSocket close code a call's end comes with (the words are the room's: serving/room.py).
CLOSE_CODES = {EndReason.TIME_LIMIT: 1000, EndReason.IDLE: 1000, EndReason.QUEUE_TIMEOUT: 1013,
               EndReason.OVERLOADED: 1013, EndReason.SHUTDOWN: 1001, EndReason.NOT_READING: 1008}
# The close codes of bad input (RFC 6455): data of a kind not taken, data that cannot be read, a
# request or pace refused.
UNSUPPORTED_DATA, INVALID_DATA, POLICY = 1003, 1007, 1008
# A refusal that is not the caller's to fix: its error code and words, then the close's code and words.
ROOM_REFUSALS = {
    RefusalKind.FULL: (e.ROOM_FULL, "the room is full and its queue too ({}); try again in a minute", 1013,
                       "the room is full"),
    RefusalKind.CLOSED: (e.ROOM_CLOSED, "the room is not taking calls: {}", 1001, "the room is closed"),
}


def room_refusal(refusal: Refusal, event_id: str | None) -> tuple[RealtimeError, int, str]:
    """The room's refusal as the client hears it: raised when the request was bad (the caller's to fix),
    else the error to send and the close's code and words."""
    exc = refusal.error
    if refusal.kind == RefusalKind.CALLER:
        code = (e.UNKNOWN_VOICE if isinstance(exc, UnknownVoiceError) else
                e.PERSONA_TOO_LONG if isinstance(exc, PersonaTooLongError) else e.INVALID_FIELD)
        raise RealtimeError(code, str(exc), param="session", event_id=event_id)
    code, words, close_code, reason = ROOM_REFUSALS[refusal.kind]
    return RealtimeError(code, words.format(exc), event_id=event_id, kind="server_error"), close_code, reason


class Refused(Exception):
    """Bad input that ends the call: the socket is closed with `code` (see `ApiSocket.refuse`)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class ApiSocket(Wire):
    """The door's side of one accepted socket; `run` returns when it has closed. By default its
    events are JSON, read and written as the Realtime API's."""

    start_hint = "send an event that starts one"  # what a client that starts no call should do
    known: tuple[str, ...] = KNOWN  # the client events taken, and those refused with a reason
    unsupported: dict[str, str] = UNSUPPORTED
    hears_speech = False  # the speech detector runs on the caller's audio (`on_speech`)

    def __init__(self, ws: WebSocket, door: SocketDoor) -> None:
        super().__init__(ws)
        self.config, self.stats, self.rules = door.config, door.stats, door.rules
        self.door_call = DoorCall(door.room, door.kind)
        self.speech = SpeechEvents(self.config.speech if self.hears_speech else SpeechConfig(enabled=False),
                                   self.on_speech)  # hears each frame the feeder hands the room
        self.feeder = Feeder(self.config, self.door_call, self.speech.hear)
        self.room_events = False  # personaplex.* events (queue, live, ended): clients that know them opt in
        self.frames_out = 0

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
        return event("error", error=err.as_error())

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
        self.room_event("call_ended", reason=reason, message=message)
        self.tell_ended(reason, message)
        await self.close(CLOSE_CODES.get(reason, 1011), message)

    def tell_ended(self, reason: str, message: str) -> None:
        """The end in the protocol's words, beside the room event; by default an `error` (code
        call_ended) to a client without room events."""
        if not self.room_events:
            self.error(RealtimeError(e.CALL_ENDED, f"the call ended ({reason}): {message}", kind="server_error"))

    # ---- its events and its call ---------------------------------------------------------------

    async def run(self) -> None:
        """Serve the socket until it closes (the door counts it open and closed)."""
        self.opened()
        self.spawn(self._expect_a_call())
        try:
            await self.serve()
        finally:  # the call goes with the socket (a call that ended keeps its reason)
            self.door_call.hang_up()
            self.speech.close()
            log.info("%s %s closed: %d frames in, %d out", self.protocol, self.session_id, self.feeder.frames_in,
                     self.frames_out)

    async def receive(self, data: str | bytes | None) -> None:
        try:
            await self.handle(self.parse(data))
        except Refused as refused:
            await self.refuse(refused.code, refused.reason)
        except RealtimeError as err:
            self.error(err)
        except Exception:  # a bug here must not cost the caller the call: say so and go on
            log.exception("%s %s: handling an event failed", self.protocol, self.session_id)
            self.error(RealtimeError(e.INTERNAL_ERROR, "the server failed on this event; it was dropped",
                                     kind="server_error"))

    async def _expect_a_call(self) -> None:
        """An open socket holds a place in its client's socket limit: one that starts no call is closed."""
        await asyncio.sleep(self.config.start_timeout_seconds)
        if self.call is None:
            self.error(RealtimeError(e.NO_SESSION, f"no call was started within {self.config.start_timeout_seconds:g}"
                                     f" s of connecting; {self.start_hint}", kind="server_error"))
            await self.close(1000, "no call was started")

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
            await self.start_call(voice, persona, sampling, None)
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

    async def start_call(self, voice: str, persona: str, sampling: SamplingParams,
                         event_id: str | None) -> bool:
        """Ask the room for the call; True once it holds one (seated or queued). A refusal is the
        client's error: raised for a bad request, sent (and the socket closed) otherwise."""
        if (refusal := await self.door_call.start(voice, persona, sampling)) is not None:
            err, close_code, reason = room_refusal(refusal, event_id)
            self.error(err)
            await self.close(close_code, reason)
            return False
        call = self.door_call.call
        if self.closing:  # the socket went while the room placed the call
            self.door_call.hang_up()
            return False
        log.info("%s %s: call %s (%s), voice %s, persona %r", self.protocol, self.session_id, call.id,
                 call.state, voice, persona if len(persona) <= 200 else persona[:200] + "…")
        self.spawn(self._run(call))
        return True

    async def _run(self, call: CallHandle) -> None:
        """The room's events as the protocol's hooks, until the call ends or the client stops reading."""
        try:
            async for ev in self.feeder.events():
                match ev:
                    case Queued(position=position, reason=reason):
                        self.room_event("queue", position=position, reason=reason)
                    case Preparing():
                        self.room_event("preparing")
                    case Live():
                        self.room_event("live", call_id=call.id, time_left=call.time_left())
                        self.on_live(call)
                    case Frame(out=out):
                        self.frames_out += 1
                        self.on_frame(out)
                    case Ended(reason=reason):
                        await self.on_ended(reason)
                    case None if self.client_stopped_reading(self.config.send_backlog_seconds):
                        log.warning("%s %s: the client stopped reading; closing", self.protocol,
                                    self.session_id)
                        self.door_call.hang_up(EndReason.NOT_READING)
                        self.stats.error("client_not_reading")
                        await self.close(1008, "the client stopped reading its audio")
                        return
        except Exception as exc:
            log.exception("%s %s: the call's runner failed", self.protocol, self.session_id)
            self.door_call.hang_up(EndReason.error(f"{self.protocol} door: {type(exc).__name__}"))
            await self.close(1011, "the server failed on this call")


def presented_key(headers: Mapping[str, str], subprotocols: Sequence[str]) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, else the browsers' subprotocol."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return next((proto.removeprefix(KEY_SUBPROTOCOL) for proto in subprotocols if proto.startswith(KEY_SUBPROTOCOL)),
                None)


class DoorStats:
    """What a door counts of itself, for /api/status and /metrics: open sockets, sockets refused at
    the door, and error events by code. The room counts the calls (by door)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sockets_open = 0
        self.sockets_total = 0
        self.refused: collections.Counter[str] = collections.Counter()  # "api_key", "too_many_sockets"
        self.errors: collections.Counter[str] = collections.Counter()  # error events sent, by code

    def opened(self) -> None:
        with self._lock:
            self.sockets_open += 1
            self.sockets_total += 1

    def closed(self) -> None:
        with self._lock:
            self.sockets_open -= 1

    def refuse(self, why: str) -> None:
        with self._lock:
            self.refused[why] += 1

    def error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {"sockets_open": self.sockets_open, "sockets_total": self.sockets_total,
                    "refused": dict(self.refused), "errors": dict(self.errors)}


class SocketDoor(Collector):
    """One door of the table. Subclasses name it (`kind`, `path`, `label`) and open its sockets;
    as a Collector it gives the door's /metrics rows."""

    kind: ClassVar[str]  # its calls' label in the room, its /api/status key, its metrics' prefix
    path: ClassVar[str]
    label: ClassVar[str]  # for people: /metrics help and the log
    # Admission by the API key and a count of open sockets per client address. A door whose
    # client cannot carry a key (a phone network) admits by a check of its own instead.
    keyed: ClassVar[bool] = True

    def __init__(self, room: Room, rules: PromptRules, config: ApiConfig, stats: DoorStats) -> None:
        self.room, self.rules, self.config, self.stats = room, rules, config, stats

    @classmethod
    def enabled(cls, config: ApiConfig) -> bool:
        return True

    def key_required(self) -> bool:
        return self.config.api_key is not None

    def presented_key(self, ws: WebSocket) -> str | None:
        return presented_key(ws.headers, list(ws.scope.get("subprotocols") or []))

    async def check(self, ws: WebSocket) -> bool:
        """Before the key and the count: False when the socket was refused (and told why) here."""
        return True

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        """For an admitted socket: the words for the log and the protocol that serves it."""
        raise NotImplementedError

    def subprotocol(self, ws: WebSocket) -> str | None:
        """The subprotocol the accepted socket names (browsers fail a handshake without one they offered)."""
        return None

    def routes(self) -> list[BaseRoute]:
        """HTTP routes the door adds beside its socket's (in the main process)."""
        return []

    def status(self) -> dict[str, Any]:
        """For /api/status."""
        extra = {"max_sockets_per_client": self.config.max_sockets_per_client} if self.keyed else {}
        return {"path": self.path, "api_key_required": self.keyed and self.key_required(), **extra,
                **self.stats.as_dict()}

    def collect(self) -> Iterable[Metric]:
        s, prefix = self.stats.as_dict(), f"personaplex_{self.kind}"
        yield GaugeMetricFamily(f"{prefix}_sockets", f"Open {self.label} sockets.", value=s["sockets_open"])
        refused = CounterMetricFamily(f"{prefix}_sockets_refused",
                                      f"{self.label} sockets refused at the door, by why.", labels=["why"])
        for why, count in sorted({"api_key": 0, "too_many_sockets": 0, **s["refused"]}.items()):
            refused.add_metric([why], count)
        yield refused
        errors = CounterMetricFamily(f"{prefix}_errors",
                                     f"Error events sent to {self.label} clients, by code.", labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors


async def deny(ws: WebSocket, status: int, code: str, message: str) -> None:
    """Refuse a socket before accepting it, with an HTTP answer its client can read."""
    body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status))
    except RuntimeError:  # a server without the denial-response extension: a bare 403
        await ws.close(1008, message[:120])
