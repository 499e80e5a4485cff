"""The phone door: Twilio Media Streams into the room (docs/phone.md § What happens on a call). Only
a call that came through a signed webhook reaches a slot, and only once: its stream URL carries a
one-time ticket, which also holds the call's settings (Twilio limits a stream's parameters)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import secrets
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import av
import numpy as np
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.websockets import WebSocket

from ..call_settings import DEFAULT_VOICE, load_presets
from ..frame import SAMPLE_RATE
from ..serving.room import CallState, SlotOutput
from . import errors as e
from .client_events import ClientEvent
from .config import ApiConfig
from .errors import RealtimeError
from .feeder import to_pcm16
from .session import SessionSettings, check_persona
from .socket_base import INVALID_DATA, POLICY, UNSUPPORTED_DATA, ApiSocket, Refused, SocketDoor, deny

log = logging.getLogger(__name__)

WEBHOOK_PATH = "/telephony/twilio"
CALL_HEADER = b"x-personaplex-phone-call"  # the call's settings, set here on an admitted socket
PHONE_RATE = 8000  # Twilio Media Streams: audio/x-mulaw, 8 kHz, one channel, both ways
CHUNK_BYTES = PHONE_RATE // 50  # 20 ms of mu-law, the size Twilio sends
MAX_PAYLOAD_BYTES = 2 * PHONE_RATE  # 2 s of mu-law in one media event: far past anything Twilio sends
HOLD_STEP_SECONDS = 0.08  # a waiting caller's tone goes out in steps of this much audio


class Tickets:
    """One-time stream tickets, each with its call's settings; unused ones lapse after `seconds`. Thread-safe."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._open: dict[str, tuple[float, SessionSettings]] = {}
        self._lock = threading.Lock()

    def issue(self, call: SessionSettings) -> str:
        ticket = secrets.token_urlsafe(18)
        now = time.monotonic()
        with self._lock:
            self._open = {t: held for t, held in self._open.items() if held[0] > now}
            self._open[ticket] = (now + self.seconds, call)
        return ticket

    def take(self, ticket: str) -> SessionSettings | None:
        with self._lock:
            until, call = self._open.pop(ticket, (0.0, None))
        return call if until > time.monotonic() else None


def public_url(request: Request) -> str:
    """The URL Twilio requested, as it signed it: behind a proxy (a Space) the scheme and host come in
    X-Forwarded-Proto and X-Forwarded-Host. Trusting them costs nothing: only the account's token signs."""
    headers = request.headers
    scheme = headers.get("x-forwarded-proto", request.url.scheme).split(",")[0].strip()
    host = headers.get("x-forwarded-host", headers.get("host", request.url.netloc)).split(",")[0].strip()
    query = f"?{request.url.query}" if request.url.query else ""
    return f"{scheme}://{host}{request.url.path}{query}"


def twiml_connect(stream_url: str, parameters: dict[str, str]) -> str:
    """TwiML that connects the call to the stream socket, with the call's settings as parameters."""
    from twilio.twiml.voice_response import Connect, VoiceResponse

    response, connect = VoiceResponse(), Connect()
    stream = connect.stream(url=stream_url)
    for name, value in parameters.items():
        stream.parameter(name=name, value=value)
    response.append(connect)
    return str(response)


class TwilioDoor(SocketDoor):
    kind, path, label = "twilio", WEBHOOK_PATH + "/stream/{ticket}", "phone (Twilio Media Streams)"
    keyed = False  # a phone network carries no key; a signed webhook's ticket admits the socket

    @functools.cached_property
    def tickets(self) -> Tickets:
        return Tickets(self.config.phone_ticket_seconds)

    @classmethod
    def enabled(cls, config: ApiConfig) -> bool:
        return config.twilio_auth_token is not None

    async def check(self, ws: WebSocket) -> bool:
        call = self.tickets.take(ws.path_params.get("ticket", ""))
        if call is not None:
            # The voice and persona ride with the socket to the process that serves it, as the only
            # such header (a client's own is dropped).
            settings = json.dumps({"voice": call.voice, "persona": call.persona}).encode()
            headers = [h for h in ws.scope["headers"] if h[0] != CALL_HEADER]
            ws.scope["headers"] = [*headers, (CALL_HEADER, base64.urlsafe_b64encode(settings))]
            return True
        self.stats.refuse("ticket")
        await deny(ws, 403, "invalid_ticket", "a stream socket needs the one-time URL a signed webhook answered")
        return False

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        socket = TwilioSocket(ws, self)
        return f"phone (voice {socket.phone_call.voice})", socket

    def routes(self) -> list[BaseRoute]:
        return [Route(WEBHOOK_PATH, self.webhook, methods=["POST"])]

    def status(self) -> dict[str, Any]:
        return {**super().status(), "webhook": WEBHOOK_PATH}

    async def webhook(self, request: Request) -> Response:
        """The voice webhook: a signed request from Twilio gets TwiML that connects the call."""
        from twilio.request_validator import RequestValidator

        form = await request.form()
        url = public_url(request)
        signature = request.headers.get("x-twilio-signature", "")
        if request.headers.get("x-twilio-webhooks-signature-settings"):
            # Signed with a webhook shared key, not the auth token this door holds.
            return self._refuse_signature(url, "a shared key's signature", "this door checks signatures made with the "
                                          "account's auth token; turn off shared-key signing for this webhook")
        if not RequestValidator(self.config.twilio_auth_token).validate(url, form, signature):
            return self._refuse_signature(url, "a wrong signature" if signature else "no signature",
                                          "the X-Twilio-Signature does not match this request and the account's "
                                          "auth token")
        try:
            call = self._call_of(request.query_params)
        except RealtimeError as err:
            self.stats.refuse("bad_request")
            log.warning("phone: the webhook's call was refused: %s", err.message)
            return PlainTextResponse(err.message, status_code=400)
        scheme = "ws" if url.startswith("http:") else "wss"  # Twilio itself calls https and streams to wss
        stream = f"{scheme}://{urlsplit(url).netloc}{WEBHOOK_PATH}/stream/{self.tickets.issue(call)}"
        log.info("phone: call %s from %s connected to the room", form.get("CallSid", "?"), form.get("From", "?"))
        preset = request.query_params.get("preset")
        return Response(twiml_connect(stream, {"voice": call.voice, **({"preset": preset} if preset else {})}),
                        media_type="application/xml")

    def _refuse_signature(self, url: str, what: str, reason: str) -> Response:
        self.stats.refuse("signature")
        log.warning("phone: a webhook for %s with %s was refused", url, what)
        return PlainTextResponse(reason, status_code=403)

    def _call_of(self, query: Any) -> SessionSettings:
        """The call a number's webhook URL names (RealtimeError when the room cannot take it)."""
        rules = self.rules
        voice = str(query.get("voice") or DEFAULT_VOICE).removesuffix(".pt")
        if voice not in rules.voice_names:
            raise RealtimeError(e.UNKNOWN_VOICE, f"unknown voice {voice!r}: one of {', '.join(rules.voice_names)}")
        preset, presets = query.get("preset"), load_presets()
        if preset and preset not in presets:
            raise RealtimeError(e.INVALID_FIELD, f"unknown preset {preset!r}: one of {', '.join(presets)}")
        persona = presets[preset] if preset else str(query.get("persona") or "")
        check_persona(persona, rules, "the persona", "persona")
        return SessionSettings(voice, persona)


@functools.cache
def hold_tone(seconds: float = 2.0) -> bytes:
    """A waiting caller's sound, made once: a soft 440 Hz note of half a second, then quiet, every `seconds`."""
    t = np.arange(int(PHONE_RATE * 0.5)) / PHONE_RATE
    note = np.sin(2 * np.pi * 440 * t) * np.sin(np.pi * t / 0.5) * 0.1
    cycle = np.zeros(int(PHONE_RATE * seconds))
    cycle[:note.size] = note
    return PhoneAudio().said(cycle, PHONE_RATE)


class PhoneAudio:
    """mu-law 8 kHz to the room's int16 24 kHz and back (stateful resamplers, one each way per call,
    so no sample is lost between chunks)."""

    def __init__(self) -> None:
        self._decoder = av.CodecContext.create("pcm_mulaw", "r")
        self._decoder.sample_rate, self._decoder.layout = PHONE_RATE, "mono"
        self._encoder = av.CodecContext.create("pcm_mulaw", "w")
        self._encoder.sample_rate, self._encoder.format, self._encoder.layout = PHONE_RATE, "s16", "mono"
        self._up = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
        self._down = av.AudioResampler(format="s16", layout="mono", rate=PHONE_RATE)

    def heard(self, mulaw: bytes) -> np.ndarray:
        frames = [out for decoded in self._decoder.decode(av.Packet(mulaw)) for out in self._up.resample(decoded)]
        return np.concatenate([f.to_ndarray()[0] for f in frames]) if frames else np.zeros(0, np.int16)

    def said(self, pcm: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
        """Float samples (-1..1) at `rate` as mu-law at the phone's rate."""
        frame = av.AudioFrame.from_ndarray(to_pcm16(pcm).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        frames = self._down.resample(frame) if rate != PHONE_RATE else [frame]
        return b"".join(bytes(packet) for f in frames for packet in self._encoder.encode(f))


class TwilioSocket(ApiSocket):
    protocol = "phone"
    start_hint = "a stream starts with its start event"
    frame_bytes = 4 * 330  # one room frame: four 20 ms media events

    def __init__(self, ws: WebSocket, door: SocketDoor) -> None:
        super().__init__(ws, door)
        header = ws.headers[CALL_HEADER.decode()]
        self.phone_call = SessionSettings(**json.loads(base64.urlsafe_b64decode(header)))
        self.room_events = True  # the queue's news starts and stops the hold tone
        self.audio = PhoneAudio()
        self.stream_sid: str | None = None
        self.call_sid = "?"
        self._hold: asyncio.Task | None = None

    def parse(self, data: str | bytes | None) -> ClientEvent:
        if not isinstance(data, str):
            raise Refused(UNSUPPORTED_DATA, "Twilio's stream events are JSON text messages")
        if len(data) > self.config.max_message_bytes:
            raise Refused(POLICY, f"a message over {self.config.max_message_bytes} bytes")
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("event"), str):
            raise Refused(INVALID_DATA, "a message that is not a JSON object with an event")
        return ClientEvent(body["event"], None, body)

    async def handle(self, ev: ClientEvent) -> None:
        match ev.type:
            case "media":
                self._media(ev.body.get("media"))
            case "start":
                await self._start(ev.body.get("start"))
            case "stop":
                log.info("phone %s: Twilio stopped the stream (call %s)", self.session_id, self.call_sid)
                self.door_call.hang_up()
                await self.close(1000, "the stream stopped")
            case "connected" | "mark":
                pass
            case "dtmf":
                digit = (ev.body.get("dtmf") or {}).get("digit")
                log.info("phone %s: the caller pressed %s", self.session_id, digit)
            case other:  # a newer version of the protocol: carry on without it
                self.stats.error("unknown_event")
                log.info("phone %s: ignoring an unknown event %r", self.session_id, other[:40])

    async def _start(self, start: Any) -> None:
        if self.stream_sid is not None:
            raise Refused(POLICY, "a second start event on one stream")
        if not isinstance(start, dict) or not isinstance(start.get("streamSid"), str):
            raise Refused(POLICY, "a start event without its streamSid")
        fmt = start.get("mediaFormat")
        if not isinstance(fmt, dict) or (fmt.get("encoding"), str(fmt.get("sampleRate")), str(fmt.get("channels"))) != (
                "audio/x-mulaw", str(PHONE_RATE), "1"):
            raise Refused(POLICY, f"media format {fmt!r}: this door takes audio/x-mulaw, 8000 Hz, one channel")
        self.stream_sid, self.call_sid = start["streamSid"], str(start.get("callSid") or "?")
        await self.start_checked(*self.phone_call.call_fields())

    def _media(self, media: Any) -> None:
        if self.stream_sid is None:
            raise Refused(POLICY, "a media event before the start event")
        payload = media.get("payload") if isinstance(media, dict) else None
        if not isinstance(payload, str) or len(payload) > MAX_PAYLOAD_BYTES * 4 // 3 + 4:
            raise Refused(POLICY, f"a media event needs a base64 payload of at most {MAX_PAYLOAD_BYTES} bytes")
        try:
            mulaw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise Refused(INVALID_DATA, "a media payload that is not base64") from None
        if not mulaw or media.get("track", "inbound") != "inbound":
            return
        if self.call is None or self.call.state != CallState.LIVE:
            return  # not heard yet: a waiting caller costs no decoding
        self.feeder.append_pcm(self.audio.heard(mulaw))

    def error_event(self, err: RealtimeError) -> None:
        return None  # Twilio's protocol has no error message: counted and logged only

    def room_event(self, kind: str, **fields: Any) -> None:
        """The room's news, as marks in the outgoing audio (Twilio names each back once the caller has
        heard up to it): `queue-<place>` while waiting, with the hold tone; `live` where the agent starts."""
        if kind == "queue":
            self._mark(f"queue-{fields.get('position')}")
            if self._hold is None:
                log.info("phone %s: waiting, place %s", self.session_id, fields.get("position"))
                self._hold = self.spawn(self._play_hold_tone())
        elif kind in ("preparing", "live"):
            if self._hold is not None:
                self._hold.cancel()
                self._hold = None
            if kind == "live":
                self._mark("live")

    def _mark(self, name: str) -> None:
        self.send(json.dumps({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}}))

    async def _play_hold_tone(self) -> None:
        """The tone, paced against the clock (Twilio plays what it gets at once: sent faster it
        would pile up ahead of the agent's first words)."""
        tone, step = hold_tone(), int(PHONE_RATE * HOLD_STEP_SECONDS)
        loop = asyncio.get_running_loop()
        start, sent = loop.time(), 0
        while True:
            offset = (sent * step) % len(tone)
            self._send_audio(tone[offset:offset + step])
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * HOLD_STEP_SECONDS - loop.time()))

    def _send_audio(self, mulaw: bytes) -> None:
        for i in range(0, len(mulaw), CHUNK_BYTES):
            payload = base64.b64encode(mulaw[i:i + CHUNK_BYTES]).decode()
            self.send(json.dumps({"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}},
                                 separators=(",", ":")), audio=i == 0)

    def on_frame(self, out: SlotOutput) -> None:
        self._send_audio(self.audio.said(out.pcm))

    def tell_ended(self, reason: str, message: str) -> None:
        log.info("phone %s: the room ended call %s (%s): %s", self.session_id, self.call_sid, reason, message)
