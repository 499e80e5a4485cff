"""One Realtime WebSocket: the OpenAI Realtime protocol on an API socket (docs/realtime.md § Session).
The voice and persona are played into the slot once, so the call starts at the first `response.create`
or once the client has changed nothing for `settle_seconds`; later changes are kept without an `error`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.websockets import WebSocket

from ..serving.room import SlotOutput
from .client_events import ClientEvent, field
from .conversation import Conversation, TurnTracker
from .errors import RealtimeError
from .server_events import event, new_id
from .session import Dialect, SessionSettings, apply_update, check_persona, join_persona, session_object
from .socket_base import ApiSocket, SocketDoor

log = logging.getLogger(__name__)

BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


class RealtimeDoor(SocketDoor):
    kind, path, label = "realtime", "/v1/realtime", "Realtime API"

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        socket = RealtimeSocket(ws, self)
        return f"realtime ({socket.dialect.value} events)", socket

    def subprotocol(self, ws: WebSocket) -> str | None:
        return "realtime" if "realtime" in (ws.scope.get("subprotocols") or []) else None


class RealtimeSocket(ApiSocket):
    protocol = "realtime"
    start_hint = "send audio or response.create to start one"
    hears_speech = True

    def __init__(self, ws: WebSocket, door: SocketDoor) -> None:
        super().__init__(ws, door)
        # The beta event names for clients that ask for them (`OpenAI-Beta: realtime=v1`).
        beta = ("realtime=v1" in ws.headers.get("openai-beta", "").replace(" ", "")
                or BETA_SUBPROTOCOL in (ws.scope.get("subprotocols") or []))
        self.dialect = dialect = Dialect.BETA if beta else Dialect.CURRENT
        self.settings = SessionSettings()
        self.conversation = Conversation(dialect)
        self.turns = TurnTracker(dialect, self.config.turn_end_seconds, self.config.speech_dbfs,
                                 self.conversation)
        self.update_refused = False  # a session.update was refused and none taken since
        self._changed_at = time.monotonic()  # the last change to the call's settings before it started
        self._starting = False
        self._starter: asyncio.Task | None = None
        self._speech_item: str | None = None  # the user item the caller's current speech becomes
        self._context: list[str] = []  # text items before the start: they follow the instructions in the persona
        self._reply_instructions: str | None = None  # a response.create's before the start: the whole persona

    def opened(self) -> None:
        self.send(event("session.created", session=self._session()))

    def _session(self) -> dict[str, Any]:
        return session_object(self.settings, self.dialect, self.session_id, self.config.model_name)

    # ---- client events -------------------------------------------------------------------------

    async def handle(self, ev: ClientEvent) -> None:
        match ev.type:
            case "session.update":
                self._update(ev)
            case "input_audio_buffer.append":
                self.feeder.append(field(ev, "audio", str), ev.event_id)  # before a call, one not PCM16 is refused
                if self.call is None and not self.update_refused:
                    self._start_soon()
            case "input_audio_buffer.clear":
                self.feeder.audio.clear()
                self.send(event("input_audio_buffer.cleared"))
            case "input_audio_buffer.commit":
                # Nothing to commit: the model hears the audio as it comes. Acknowledged for clients
                # that commit at the end of the user's turn.
                self.send(event("input_audio_buffer.committed", previous_item_id=self.conversation.last_item,
                                item_id=new_id("item")))
            case "response.create":
                response = ev.body.get("response") if isinstance(ev.body.get("response"), dict) else {}
                if self.call is None and not self.update_refused:
                    if isinstance(response.get("instructions"), str):  # the whole persona for this reply
                        check_persona(response["instructions"], self.rules, "the reply's instructions (the persona)",
                                      "response.instructions", ev.event_id)
                        self._reply_instructions = response["instructions"]
                    await self._start(ev.event_id)
                self.send_all(self.turns.request(response.get("metadata")))
            case "response.cancel":
                # Nothing open is nothing to cancel, not an error: the response ended already, most
                # often cancelled by the caller's speech a moment before (LiveKit cancels twice).
                self.send_all(self.turns.cancel())
            case "conversation.item.create":
                self._create_item(ev)
            case "conversation.item.truncate":
                truncated = self.conversation.truncate(ev)
                current = self.turns.current
                # The caller cut the agent off.
                if current is not None and truncated["item_id"] == current.item_id:
                    self.send_all(self.turns.cancel())
                self.send(truncated)
            case "conversation.item.delete":
                self.send(self.conversation.delete(ev))

    def _update(self, ev: ClientEvent) -> None:
        started = self.call is not None or self._starting
        try:
            self.settings = apply_update(self.settings, field(ev, "session", dict), self.rules, started=started,
                                         event_id=ev.event_id)
        except RealtimeError:
            self.update_refused = not started
            raise
        self.update_refused = False
        self.room_events = self.settings.room_events
        if self.settings.locked:
            log.info("realtime %s: %s kept as the call started (the model takes them once)", self.session_id,
                     ", ".join(self.settings.locked))
        self._changed_at = time.monotonic()
        self.send(event("session.updated", session=self._session()))
        if not started:
            self._start_soon()

    def _create_item(self, ev: ClientEvent) -> None:
        events, text = self.conversation.create(ev)
        if text is not None and self.call is None and not self._starting:
            check_persona(join_persona(self.settings.persona, *self._context, text), self.rules,
                          "the persona with this item's text", "item", ev.event_id)
            self._context.append(text)
            self._changed_at = time.monotonic()
            self._start_soon()
        elif text is not None:
            log.info("realtime %s: a text item after the call started is kept in the conversation and not heard",
                     self.session_id)
        self.send_all(events)

    # ---- the call ------------------------------------------------------------------------------

    def _start_soon(self) -> None:
        if self._starter is None or self._starter.done():
            self._starter = self.spawn(self._start_when_settled())

    async def _start_when_settled(self) -> None:
        """Start the call once the client has changed nothing for `settle_seconds`."""
        while self.call is None and not self._starting and not self.closing:
            wait = self._changed_at + self.config.settle_seconds - time.monotonic()
            if wait <= 0:
                try:
                    await self._start(None)
                except RealtimeError as err:
                    self.error(err)
                return
            await asyncio.sleep(wait)

    async def _start(self, event_id: str | None) -> None:
        if self.call is not None or self._starting or self.update_refused:
            return
        self._starting = True
        # The persona: the instructions (a reply's, else the session's), then the context's text.
        instructions = self._reply_instructions if self._reply_instructions is not None else self.settings.persona
        try:
            await self.start_call(self.settings.voice, join_persona(instructions, *self._context),
                                  self.settings.sampling, event_id)
        finally:
            self._starting = False

    def on_frame(self, out: SlotOutput) -> None:
        self.send_all(self.turns.frame(out.pcm, out.text))

    def on_speech(self, kind: str, ms: int) -> None:
        """Server VAD as the Realtime API has it: the open response is cancelled when the caller
        starts to speak (pipecat expects the server to do so), and what they said becomes an
        audio item when they stop."""
        if not self.settings.speech_events:
            return
        if kind == "started":
            self._speech_item = new_id("item")
            self.send(event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self._speech_item))
            self.send_all(self.turns.cancel("turn_detected"))
        elif self._speech_item is not None:
            item_id, self._speech_item = self._speech_item, None
            self.send(event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
            self.send_all(self.conversation.user_audio(item_id))

    async def on_ended(self, reason: str) -> None:
        self.send_all(self.turns.cancel(reason))
        await super().on_ended(reason)
