"""A phone network as Twilio's documentation describes it, for the phone door's tests and bench.

- The voice webhook: a form POST of the call's fields (`CallSid`, `From`, `To`, ...) signed with
  the account's auth token (`X-Twilio-Signature`: HMAC-SHA1 over the full URL and the sorted form
  fields, base64; computed by the `twilio` package, the reference), answered with TwiML.
- The TwiML's `<Connect><Stream url=...>` and its `<Parameter>`s.
- The stream socket, Media Streams' messages: `connected`, `start` (streamSid, callSid,
  accountSid, tracks, mediaFormat, customParameters), then a `media` event every 20 ms of the
  caller's mu-law 8 kHz audio (`track`, `chunk`, `timestamp` in ms, `payload` in base64), each
  with its `sequenceNumber`; `dtmf`; `stop`. What the server sends: `media` (played in order) and
  `mark` (named back once what came before it has played: here at once, as nothing is played).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import av
import httpx
import numpy as np
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection, connect

RATE = 8000
CHUNK = 160  # 20 ms
ACCOUNT = "AC" + "0" * 32


def sid(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


@dataclass
class Twiml:
    status: int
    text: str
    stream_url: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)


async def place_call(http: httpx.AsyncClient, url: str, token: str | None, *, call_sid: str | None = None,
                     signature: str | None = None, public_url: str | None = None,
                     headers: dict[str, str] | None = None) -> Twiml:
    """The webhook request Twilio makes when the number rings: the form fields of a voice call,
    signed with `token` (or with the given `signature`) over `public_url` (the URL Twilio called,
    when a proxy stands between it and `url`)."""
    form = {"AccountSid": ACCOUNT, "ApiVersion": "2010-04-01", "CallSid": call_sid or sid("CA"),
            "CallStatus": "ringing", "Called": "+15005550006", "Caller": "+14155550100", "Direction": "inbound",
            "From": "+14155550100", "To": "+15005550006"}
    if signature is None and token is not None:
        signature = RequestValidator(token).compute_signature(public_url or url, form)
    headers = {**(headers or {}), **({"X-Twilio-Signature": signature} if signature is not None else {})}
    r = await http.post(url, data=form, headers=headers)
    twiml = Twiml(r.status_code, r.text)
    if r.status_code == 200:
        stream = ET.fromstring(r.text).find("./Connect/Stream")
        if stream is not None:
            twiml.stream_url = stream.get("url")
            twiml.parameters = {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
    return twiml


def mulaw(pcm: np.ndarray) -> bytes:
    """int16 8 kHz samples as mu-law bytes (PyAV's G.711 encoder)."""
    encoder = av.CodecContext.create("pcm_mulaw", "w")
    encoder.sample_rate, encoder.format, encoder.layout = RATE, "s16", "mono"
    frame = av.AudioFrame.from_ndarray(pcm.astype(np.int16).reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = RATE
    return b"".join(bytes(p) for p in encoder.encode(frame))


def linear(data: bytes) -> np.ndarray:
    """mu-law bytes as int16 samples."""
    decoder = av.CodecContext.create("pcm_mulaw", "r")
    decoder.sample_rate, decoder.layout = RATE, "mono"
    frames = decoder.decode(av.Packet(data)) if data else []
    return np.concatenate([f.to_ndarray()[0] for f in frames]) if frames else np.zeros(0, np.int16)


def caller_voice(seconds: float, seed: int = 0) -> np.ndarray:
    """Something to say: a gliding tone in syllable-length bursts, 8 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t + seed)
    envelope = (np.sin(2 * np.pi * 3 * t + seed) > -0.3).astype(np.float32)
    return (6000 * envelope * np.sin(2 * np.pi * np.cumsum(pitch) / RATE)).astype(np.int16)


class PhoneStream:
    """One call's stream socket as Twilio drives it: events in, what it hears kept with arrival
    times, marks named back as they come (nothing is played here)."""

    def __init__(self, twiml: Twiml, call_sid: str | None = None) -> None:
        assert twiml.stream_url, twiml.text
        self.twiml = twiml
        self.stream_sid, self.call_sid = sid("MZ"), call_sid or sid("CA")
        self.ws: ClientConnection | None = None
        self.heard = bytearray()  # the agent's mu-law, in order
        self.arrivals: list[tuple[float, int]] = []  # (monotonic time, bytes heard so far) per media event
        self.marks: list[tuple[float, str]] = []
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.Event()
        self._sequence = 0  # every message after `connected`
        self._chunks = 0  # media messages, from 1
        self._sent_ms = 0
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> PhoneStream:
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.hang_up()

    async def open(self, *, start: bool = True, read: bool = True, **connect_kwargs) -> None:
        self.ws = await connect(self.twiml.stream_url, max_size=None, **connect_kwargs)
        if read:
            self._reader = asyncio.create_task(self._read())
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"}, numbered=False)
        if start:
            await self.start()

    async def start(self, media_format: dict | None = None) -> None:
        await self.send({"event": "start", "start": {
            "accountSid": ACCOUNT, "streamSid": self.stream_sid, "callSid": self.call_sid, "tracks": ["inbound"],
            "mediaFormat": media_format or {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": self.twiml.parameters}})

    async def send(self, message: dict, numbered: bool = True) -> None:
        if numbered:
            self._sequence += 1
            message = {**message, "sequenceNumber": str(self._sequence), "streamSid": self.stream_sid}
        await self.ws.send(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send(data)

    async def media(self, chunk: bytes) -> None:
        self._chunks += 1
        await self.send({"event": "media", "media": {"track": "inbound", "chunk": str(self._chunks),
                                                     "timestamp": str(self._sent_ms),
                                                     "payload": base64.b64encode(chunk).decode()}})
        self._sent_ms += len(chunk) * 1000 // RATE

    async def talk(self, pcm: np.ndarray, seconds: float | None = None) -> None:
        """Send `pcm` (8 kHz int16, looped) as the phone does: 20 ms every 20 ms, for `seconds`."""
        data = mulaw(pcm)
        count = int((seconds if seconds is not None else len(pcm) / RATE) * 50)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(count):
            offset = (i * CHUNK) % len(data)
            await self.media(data[offset:offset + CHUNK])
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - loop.time()))

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                ev = json.loads(message)
                if ev.get("event") == "media":
                    self.heard += base64.b64decode(ev["media"]["payload"])
                    self.arrivals.append((time.monotonic(), len(self.heard)))
                elif ev.get("event") == "mark":
                    self.marks.append((time.monotonic(), ev["mark"]["name"]))
                    await self.send({"event": "mark", "mark": ev["mark"]})
        except Exception:
            pass
        finally:
            self.close_code, self.close_reason = self.ws.close_code, self.ws.close_reason or ""
            self.closed.set()

    def mark_names(self) -> list[str]:
        return [name for _, name in self.marks]

    def mark_time(self, name: str) -> float | None:
        return next((at for at, n in self.marks if n == name), None)

    def heard_since(self, at: float) -> int:
        """Bytes (samples) of audio that arrived after `at`."""
        before = next((n for t, n in reversed(self.arrivals) if t <= at), 0)
        return len(self.heard) - before

    async def stop(self) -> None:
        """Twilio's end of a stream: the caller hung up."""
        await self.send({"event": "stop", "stop": {"accountSid": ACCOUNT, "callSid": self.call_sid}})

    async def hang_up(self) -> None:
        if self.ws is None:
            return
        with contextlib.suppress(Exception):
            await self.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 3)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 3)

    async def wait_closed(self, seconds: float) -> tuple[int | None, str]:
        await asyncio.wait_for(self.closed.wait(), seconds)
        return self.close_code, self.close_reason
