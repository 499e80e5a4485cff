"""Callers through the Realtime API with the official `openai` SDK, as a user's script holds them
(tests/test_realtime_api.py, tests/test_media_workers.py, bench/realtime.py), and through the
GPT-Live door with plain `websockets` (`LiveClient`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosed

from .callers import until

AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
TEXT_DELTAS = ("response.output_audio_transcript.delta", "response.audio_transcript.delta")


def speech_pcm(directory: Path, text: str = "Hello there. Can you tell me about the weather on Mars today?"
               ) -> np.ndarray:
    """Spoken words as 24 kHz 16-bit mono samples (espeak-ng, then sox), via a WAV file."""
    raw, wav = directory / "speech_raw.wav", directory / "speech_24k.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", "24000", "-c", "1", "-b", "16", str(wav)], check=True)
    samples, rate = soundfile.read(wav, dtype="int16")
    assert rate == 24000
    return samples


def client(base_url: str, key: str | None) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key or "none", websocket_base_url=base_url.replace("http", "ws", 1) + "/v1",
                       max_retries=0)


class SdkCaller:
    """One session: `async with SdkCaller(...) as caller`. A reader task keeps every server event
    with its arrival time; `stream` sends audio in real time."""

    def __init__(self, base_url: str, key: str | None, *, beta: bool = False) -> None:
        self.client = client(base_url, key)
        self.beta = beta
        self.events: list[tuple[float, Any]] = []
        self.audio: list[tuple[float, int]] = []  # (arrival, samples) per audio delta
        self.transcript = ""
        self.errors: list[Any] = []
        self.live_at: float | None = None
        self.ended = asyncio.Event()
        self.conn: Any = None
        self._manager: Any = None
        self._reader: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def __aenter__(self) -> SdkCaller:
        realtime = self.client.beta.realtime if self.beta else self.client.realtime
        self._manager = realtime.connect(model="personaplex")
        self.conn = await self._manager.enter()
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.conn.close()
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self) -> None:
        try:
            async for event in self.conn:
                now = time.monotonic()
                self.events.append((now, event))
                if event.type in AUDIO_DELTAS:
                    self.audio.append((now, len(base64.b64decode(event.delta)) // 2))
                elif event.type in TEXT_DELTAS:
                    self.transcript += event.delta
                elif event.type == "error":
                    self.errors.append(event.error)
                elif event.type == "personaplex.live":
                    self.live_at = now
                self._changed.set()
        except ConnectionClosed:
            pass
        finally:
            self.ended.set()
            self._changed.set()

    async def configure(self, voice: str = "NATF2", persona: str = "", **ours: Any) -> None:
        """session.update in the client's shape, with the room's own events on."""
        ours = {"room_events": True, **ours}
        if self.beta:
            session = {"voice": voice, "instructions": persona, "input_audio_format": "pcm16", "personaplex": ours}
        else:
            session = {"type": "realtime", "instructions": persona, "personaplex": ours,
                       "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                                 "output": {"voice": voice}}}
        await self.conn.session.update(session=session)

    def types(self) -> list[str]:
        return [event.type for _, event in self.events]

    async def wait_for(self, check, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := check()):
            assert not self.ended.is_set() or check(), f"the socket closed while waiting for {what}"
            left = deadline - time.monotonic()
            assert left > 0, f"waited {timeout:.0f} s for {what}; got {self.types()[-8:]}"
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return found

    async def wait_event(self, kind: str, timeout: float = 20.0, after: int = 0) -> Any:
        def found():
            return next((e for _, e in self.events[after:] if e.type == kind), None)
        return await self.wait_for(found, timeout, kind)

    async def wait_live(self, timeout: float = 30.0) -> None:
        await self.wait_for(lambda: self.live_at is not None, timeout, "personaplex.live")

    async def stream(self, samples: np.ndarray, chunk: int = 960) -> None:
        """Append `samples` at the pace they play (40 ms chunks by default)."""
        start = time.monotonic()
        for i in range(0, samples.size, chunk):
            piece = np.ascontiguousarray(samples[i:i + chunk], dtype="<i2")
            await self.conn.input_audio_buffer.append(audio=base64.b64encode(piece.tobytes()).decode())
            await asyncio.sleep(max(0.0, start + (i + chunk) / 24000 - time.monotonic()))

    def audio_seconds(self, since: float, until: float | None = None) -> float:
        until = until if until is not None else time.monotonic()
        return sum(n for at, n in self.audio if since <= at <= until) / 24000


class LiveClient:
    """A GPT-Live client over plain `websockets`: every server event kept, in order."""

    def __init__(self, ws) -> None:
        self.ws, self.events, self.closed = ws, [], asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                self.events.append((time.monotonic(), json.loads(message)))
        finally:
            self.closed.set()

    async def send(self, event: dict | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    def of(self, kind: str) -> list[dict]:
        return [e for _, e in self.events if e["type"] == kind]

    async def wait(self, kind: str, after: int = 0, timeout: float = 10.0) -> dict:
        await until(lambda: any(e["type"] == kind for _, e in self.events[after:]), timeout, kind, step=0.05)
        return next(e for _, e in self.events[after:] if e["type"] == kind)

    async def error(self, raw: dict | str) -> dict:
        seen = len(self.events)
        await self.send(raw)
        return (await self.wait("error", after=seen))["error"]


def pcm_event(samples: np.ndarray) -> dict:
    return {"type": "session.input_audio.append", "audio": base64.b64encode(samples.astype("<i2").tobytes()).decode()}


class ChatClient:
    """A client of NVIDIA's PersonaPlex protocol (/api/chat) as the reference's own clients speak it:
    binary messages, the first byte the kind; Ogg Opus through sphn both ways."""

    def __init__(self, ws) -> None:
        import sphn

        self.ws, self.messages, self.closed = ws, [], asyncio.Event()
        self.opus_out, self.opus_in = sphn.OpusStreamWriter(24000), sphn.OpusStreamReader(24000)
        self.handshake_at: float | None = None
        self.audio: list[tuple[float, int]] = []  # (arrival, samples) of the agent's audio
        self.text = ""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                now = time.monotonic()
                self.messages.append((now, message))
                if message[:1] == b"\x00" and self.handshake_at is None:
                    self.handshake_at = now
                elif message[:1] == b"\x01":
                    self.audio.append((now, self.opus_in.append_bytes(message[1:]).size))
                elif message[:1] == b"\x02":
                    self.text += message[1:].decode()
        except ConnectionClosed:  # a close with a code other than 1000: the test reads it from the socket
            pass
        finally:
            self.closed.set()

    def events(self) -> list[dict]:
        """The room's news (kind 4, with room_events=1)."""
        return [json.loads(m[1:]) for _, m in self.messages if m[:1] == b"\x04"]

    async def stream(self, samples: np.ndarray, pace: float = 1.0) -> None:
        """Send int16 samples as Ogg Opus in 80 ms frames, at `pace` times real time."""
        start = time.monotonic()
        for i in range(0, samples.size - 1919, 1920):
            opus = self.opus_out.append_pcm(samples[i:i + 1920].astype(np.float32) / 32768.0)
            if opus:
                await self.ws.send(b"\x01" + opus)
            await asyncio.sleep(max(0.0, start + (i + 1920) / 24000 / pace - time.monotonic()))

    def audio_seconds(self, since: float = 0.0, until: float | None = None) -> float:
        until = until if until is not None else time.monotonic()
        return sum(n for at, n in self.audio if since <= at <= until) / 24000

