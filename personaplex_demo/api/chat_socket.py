"""One `/api/chat` WebSocket: NVIDIA's PersonaPlex server protocol, so that the reference server's
clients call the room unchanged (docs/realtime.md § The PersonaPlex server protocol)."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.websockets import WebSocket

from ..call_settings import SamplingParams
from ..frame import SAMPLE_RATE
from ..serving.room import CallHandle, SlotOutput
from . import errors as e
from .client_events import ClientEvent
from .config import ApiConfig
from .errors import RealtimeError
from .feeder import to_pcm16
from .session import PromptRules, SessionSettings, check_persona
from .socket_base import INVALID_DATA, POLICY, UNSUPPORTED_DATA, ApiSocket, Refused, SocketDoor

log = logging.getLogger(__name__)

HANDSHAKE, AUDIO, TEXT, METADATA, ERROR = 0, 1, 2, 4, 5
OPUS_FRAME_BYTES = 400  # what 80 ms of the agent's Opus weighs on the wire, about
# The sampling names NVIDIA's web client puts in the query (the reference ignores them; they apply here).
SAMPLING = {"text_temperature": ("text_temperature", float), "text_topk": ("text_top_k", int),
            "audio_temperature": ("audio_temperature", float), "audio_topk": ("audio_top_k", int)}


def chat_request(query: Any, rules: PromptRules) -> SessionSettings:
    """The query's call, checked as a page call is; RealtimeError (its message the close reason)."""
    voice = str(query.get("voice_prompt") or "NATF2").removesuffix(".pt")
    if voice not in rules.voice_names:
        raise RealtimeError(e.UNKNOWN_VOICE, f"unknown voice_prompt {voice!r}: one of NATF0-3, NATM0-3, VARF0-4, "
                            "VARM0-4 (.pt optional)", param="voice_prompt")
    persona = str(query.get("text_prompt") or "")
    check_persona(persona, rules, "text_prompt", "text_prompt")
    knobs: dict[str, Any] = {}
    try:
        if query.get("seed") not in (None, "", "-1"):
            knobs["seed"] = int(query["seed"])
        for name, (ours, kind) in SAMPLING.items():
            if query.get(name) not in (None, ""):
                knobs[ours] = kind(query[name])
        sampling = SamplingParams(**knobs)
        sampling.validate()
    except ValueError as exc:
        raise RealtimeError(e.INVALID_SAMPLING, f"bad seed or sampling: {exc}", param="query") from None
    return SessionSettings(voice, persona, sampling, query.get("room_events") in ("1", "true"))


class ChatDoor(SocketDoor):
    """NVIDIA's protocol, with its reference clients' ways: the key may come in the query, and the
    query is checked before anything else (a bad one is told why in the protocol's words)."""

    kind, path, label = "chat", "/api/chat", "/api/chat (NVIDIA's protocol)"

    @classmethod
    def enabled(cls, config: ApiConfig) -> bool:
        return config.chat

    def key_required(self) -> bool:
        return self.config.api_key is not None and not self.config.chat_without_key

    def presented_key(self, ws: WebSocket) -> str | None:
        return super().presented_key(ws) or ws.query_params.get("api_key")

    async def check(self, ws: WebSocket) -> bool:
        try:
            chat_request(ws.query_params, self.rules)
        except RealtimeError as err:
            self.stats.refuse(err.code)
            await ws.accept()
            await ws.send_bytes(bytes([ERROR]) + err.message.encode())
            await ws.close(POLICY, err.message[:120])
            return False
        return True

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        socket = ChatSocket(ws, self)
        return f"chat (voice {socket.request.voice})", socket

    def routes(self) -> list[BaseRoute]:
        return [Route("/api/voices", self.voices)]

    async def voices(self, _: Request) -> JSONResponse:
        """The reference server's voice list, as its clients read it."""
        names = [f"{voice}.pt" for voice in self.rules.voice_names]
        return JSONResponse({"voices": names, "count": len(names)})


class ChatSocket(ApiSocket):
    protocol = "chat"
    start_hint = "the call could not be placed"
    frame_bytes = OPUS_FRAME_BYTES

    def __init__(self, ws: WebSocket, door: SocketDoor) -> None:
        super().__init__(ws, door)
        import sphn  # the reference's Opus streams; imported with the first call of this door

        self.request = chat_request(ws.query_params, door.rules)  # checked at the door
        self.room_events = self.request.room_events
        self._opus_in = sphn.OpusStreamReader(SAMPLE_RATE)
        self._opus_out = sphn.OpusStreamWriter(SAMPLE_RATE)

    def opened(self) -> None:
        self.spawn(self.start_checked(*self.request.call_fields()))

    def parse(self, data: str | bytes | None) -> ClientEvent:
        if not isinstance(data, bytes):
            raise Refused(UNSUPPORTED_DATA, "every message is binary, its first byte the kind (1: audio)")
        return ClientEvent("empty" if not data else str(data[0]), None, {"payload": data[1:]})

    async def handle(self, ev: ClientEvent) -> None:
        if ev.type == "empty":
            return  # the reference skips them too
        if ev.type != str(AUDIO):
            raise Refused(UNSUPPORTED_DATA, f"message kind {ev.type} is not taken here (1: Ogg Opus audio)")
        try:
            pcm = self._opus_in.append_bytes(ev.body["payload"])
        except ValueError as exc:
            raise Refused(INVALID_DATA, f"the audio is not an Ogg Opus stream: {exc}"[:120]) from None
        try:
            if pcm.size:
                self.feeder.append_pcm(to_pcm16(pcm))
        except RealtimeError:
            raise Refused(POLICY, "audio came faster than real time, past what this server holds") from None

    def error_event(self, err: RealtimeError) -> bytes:
        return bytes([ERROR]) + err.message.encode()  # kind 5; a refusal's close says it again

    def room_event(self, kind: str, **fields: Any) -> None:
        if self.room_events:
            self.send(bytes([METADATA]) + json.dumps({"type": f"personaplex.{kind}", **fields}).encode())

    def on_live(self, call: CallHandle) -> None:
        self.send(bytes([HANDSHAKE]))

    def on_frame(self, out: SlotOutput) -> None:
        opus = self._opus_out.append_pcm(np.asarray(out.pcm, np.float32))
        if opus:
            self.send(bytes([AUDIO]) + opus, audio=True)
        if out.text:
            self.send(bytes([TEXT]) + out.text.encode())

    def tell_ended(self, reason: str, message: str) -> None:
        """The room event only: the close says it to everyone."""
