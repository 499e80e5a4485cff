"""Helpers shared by the tests that place calls: aiortc callers, waiting for a pool to empty.

- `ToneTrack`: a microphone playing a tone in real time.
- `Caller`: an aiortc peer with the page's data channel and a tone; it counts the agent audio
  it receives and keeps the data channel's messages.
- `PageCaller`: a Caller that drives a launched app exactly as the browser page does: the offer
  through `POST /gradio_api/component_server/` (fn "offer"), the page's inputs through the
  Gradio `tick` event (on connecting and on "send_input"), and the page updates through the
  `state_change` event (the page's relay) on "fetch_output", read from Gradio's SSE stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import json
import time
import uuid
from typing import Any

import httpx
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack
from av import AudioFrame
from gradio_client.utils import apply_diff

from personaplex_demo.web import mic_hold


def follow_mic_hold(message: str, pc: Any, held: Any) -> Any:
    """What a client peer does with a data-channel `message`, as the page's script (web/mic_hold.py) does:
    on HOLD take the microphone off `pc`'s audio sender, on SEND put `held` back; returns the microphone
    held now (None: none). For Python peers (aiortc), whose senders take `replaceTrack(None)`."""
    try:
        msg = json.loads(message) if message.startswith("{") else {}
    except ValueError:
        return held
    data = msg.get("data") if msg.get("type") == "log" else None
    sender = next((s for s in pc.getSenders() if s.kind == "audio"), None)
    if sender is None:
        return held
    if data == mic_hold.HOLD and sender.track is not None:
        held = sender.track
        sender.replaceTrack(None)
    elif data == mic_hold.SEND and held is not None:
        sender.replaceTrack(held)
        held = None
    return held


async def wait_all_free(pool, seconds: float = 3.0) -> None:
    """Wait until every slot of `pool` (anything with `snapshot()` and `slots_total`) is free."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and pool.snapshot().slots_free < pool.slots_total:
        await asyncio.sleep(0.05)
    assert pool.snapshot().slots_free == pool.slots_total


def catch_up(track) -> None:
    """A microphone runs in real time whether or not anyone reads it: after a pause in reading
    (the page held it while the call waited) its next frame is the current one, not a backlog."""
    late = time.monotonic() - (track.t0 + track.n * 0.02)
    if late > 0.1:
        track.n += int(late / 0.02)


class ToneTrack(MediaStreamTrack):
    """A 48 kHz microphone playing a tone in real time, 20 ms per frame."""

    kind = "audio"

    def __init__(self, freq: float, amplitude: float = 0.3):
        super().__init__()
        self.freq, self.amplitude, self.n, self.t0 = freq, amplitude, 0, None

    async def recv(self) -> AudioFrame:
        if self.t0 is None:
            self.t0 = time.monotonic()
        catch_up(self)
        await asyncio.sleep(max(0.0, self.t0 + self.n * 0.02 - time.monotonic()))
        t = (np.arange(960) + self.n * 960) / 48000
        pcm = (self.amplitude * 32767 * np.sin(2 * np.pi * self.freq * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
        self.n += 1
        return frame


class FeedbackTrack(MediaStreamTrack):
    """A microphone beside a loudspeaker: it plays back what the caller hears, `gain` times as
    loud and `delay` seconds later (48 kHz, 20 ms a frame, in real time); silence before that."""

    kind = "audio"

    def __init__(self, delay: float = 0.15, gain: float = 0.3):
        super().__init__()
        self.gain, self.n, self.t0 = gain, 0, None
        self.heard: collections.deque[np.ndarray] = collections.deque()
        self.buffered = np.zeros(int(delay * 48000), np.float32)

    def hear(self, frame: AudioFrame) -> None:
        pcm = frame.to_ndarray().reshape(-1).astype(np.float32)
        if len(frame.layout.channels) == 2:
            pcm = pcm[::2]  # interleaved stereo: the left channel
        self.heard.append(pcm)

    async def recv(self) -> AudioFrame:
        if self.t0 is None:
            self.t0 = time.monotonic()
        catch_up(self)
        await asyncio.sleep(max(0.0, self.t0 + self.n * 0.02 - time.monotonic()))
        while self.heard:
            self.buffered = np.concatenate([self.buffered, self.heard.popleft()])
        out, self.buffered = self.buffered[:960], self.buffered[960:]
        out = np.pad(out, (0, 960 - out.size))
        pcm = np.clip(out * self.gain, -32768, 32767).astype(np.int16)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
        self.n += 1
        return frame


class Caller:
    """An aiortc peer as the page makes it: a "text" data channel, a microphone, the agent's audio."""

    def __init__(self, webrtc_id: str, voice: str = "NATF2", persona: str = "", seed: int = 7):
        self.id = webrtc_id
        self.args = [voice, persona, 0.7, 25, 0.8, 250, seed]
        # No STUN server: the peers meet on loopback, and aiortc's default (a Google STUN host) means a
        # DNS lookup in an executor thread that, on a closed network, can outlive the test's event loop.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.samples = 0
        self.energy = 0.0
        self.last_audio_at: float | None = None
        self.messages: list[str] = []
        self.held_mic: MediaStreamTrack | None = None  # the microphone, while the call waits

    def on_message(self, message: str) -> None:
        """A data channel message from the server (the page reacts to some of them)."""

    async def offer(self, freq: float, mic: MediaStreamTrack | None = None) -> dict:
        """Call with a tone of `freq` Hz as the microphone, or with `mic` (a FeedbackTrack hears
        the agent's audio as this caller receives it)."""
        channel = self.pc.createDataChannel("text")

        @channel.on("message")
        def on_message(msg):
            self.messages.append(msg)
            self.held_mic = follow_mic_hold(msg, self.pc, self.held_mic)
            self.on_message(msg)

        @self.pc.on("track")
        def on_track(track):
            async def drain():
                while True:
                    try:
                        frame = await track.recv()
                    except Exception:
                        return
                    a = frame.to_ndarray().astype(np.float64)
                    if isinstance(mic, FeedbackTrack):
                        mic.hear(frame)
                    self.samples += frame.samples
                    self.energy += float((a**2).sum())
                    self.last_audio_at = time.monotonic()
            asyncio.ensure_future(drain())

        self.pc.addTrack(mic if mic is not None else ToneTrack(freq))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await self.send_offer({"sdp": self.pc.localDescription.sdp, "type": "offer", "webrtc_id": self.id})
        if "sdp" in answer:
            await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        return answer

    async def send_offer(self, body: dict) -> dict:
        raise NotImplementedError

    async def wait_connected(self, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while self.pc.connectionState != "connected":
            assert time.monotonic() < deadline, f"{self.id}: still {self.pc.connectionState}"
            await asyncio.sleep(0.05)

    async def audio_seconds_over(self, seconds: float) -> float:
        """Seconds of agent audio (48 kHz) received during the next `seconds`."""
        before = self.samples
        await asyncio.sleep(seconds)
        return (self.samples - before) / 48000


class PageConfig:
    """The ids the page uses: its WebRTC component and the events wired to it (from /config)."""

    def __init__(self, config: dict):
        self.rtc_id = next(c["id"] for c in config["components"] if c.get("type") == "webrtc")
        self.fn = {}
        for dep in config["dependencies"]:
            for target, event in dep["targets"]:
                if target == self.rtc_id:
                    self.fn.setdefault(event, dep["id"])

    @classmethod
    async def fetch(cls, http: httpx.AsyncClient) -> PageConfig:
        return cls((await http.get("/config")).json())


class PageCaller(Caller):
    def __init__(self, http: httpx.AsyncClient, page: PageConfig, voice: str = "NATF2", persona: str = "",
                 seed: int = 7):
        super().__init__(uuid.uuid4().hex[:11], voice, persona, seed)
        self.http, self.page = http, page
        self.session = uuid.uuid4().hex[:11]
        self.outputs: list = [None] * 5  # transcript, status, call id, wav, json: as the page shows them
        self.updates: list[tuple[str, str]] = []  # (transcript, status) after each page update
        self.ended: str | None = None  # the end_stream message, if the server ended the call
        self._relay: asyncio.Task | None = None
        self._raw: list = []
        self._tasks: set[asyncio.Task] = set()
        self.pc.on("connectionstatechange", self._on_state)

    @property
    def transcript(self) -> str:
        return self.outputs[0] or ""

    @property
    def status(self) -> str:
        return self.outputs[1] or ""

    async def send_offer(self, body: dict) -> dict:
        r = await self.http.post("/gradio_api/component_server/", json={
            "session_hash": self.session, "component_id": self.page.rtc_id, "fn_name": "offer", "data": body})
        r.raise_for_status()
        return r.json()

    def _on_state(self) -> None:
        if self.pc.connectionState == "connected":
            self._spawn(self._event("tick", [self.id, *self.args]))

    def on_message(self, message: str) -> None:
        kind = json.loads(message).get("type") if message.startswith("{") else None
        if kind == "send_input":
            self._spawn(self._event("tick", [self.id, *self.args]))
        elif kind == "fetch_output" and (self._relay is None or self._relay.done()):
            # trigger_mode="once": the page starts the relay again only after it has finished.
            self._relay = self._spawn(self._event("state_change", [self.id]))
        elif kind == "end_stream":
            self.ended = json.loads(message).get("data")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _event(self, event: str, data: list) -> None:
        """Run one Gradio event as the page does: join the queue, then read its SSE stream. An app
        that stops (or a connection that drops) ends the event, as it ends the page's."""
        try:
            await self._run_event(event, data)
        except httpx.TransportError:
            pass

    async def _run_event(self, event: str, data: list) -> None:
        session = uuid.uuid4().hex[:11]
        r = await self.http.post("/gradio_api/queue/join", json={
            "data": data, "event_data": None, "fn_index": self.page.fn[event], "trigger_id": self.page.rtc_id,
            "session_hash": session})
        r.raise_for_status()
        event_id = r.json()["event_id"]
        first = True
        async with self.http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session},
                                    timeout=None) as stream:
            async for line in stream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if msg.get("event_id") not in (None, event_id):
                    continue
                if msg["msg"] in ("process_generating", "process_completed") and event == "state_change":
                    data_out = (msg.get("output") or {}).get("data")
                    if data_out is not None:
                        if first or msg["msg"] == "process_completed":
                            values = data_out
                        else:
                            values = [apply_diff(old, diff) for old, diff in zip(self._raw, data_out, strict=True)]
                        self._raw, first = values, False
                        self._show(values)
                if msg["msg"] in ("process_completed", "close_stream"):
                    return

    def _show(self, values: list) -> None:
        for i, value in enumerate(values):
            if isinstance(value, dict) and value.get("__type__") == "update":
                if "value" in value:
                    self.outputs[i] = value["value"]
            else:
                self.outputs[i] = value
        self.updates.append((self.transcript, self.status))

    async def hang_up(self) -> None:
        """The Stop button: the page closes its peer connection."""
        await self.pc.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def until(check, seconds: float, what, step: float = 0.1):
    """`check()`'s first true result, looked at every `step` s; fails after `seconds`, naming
    `what` (a string, or a function that gives one then)."""
    deadline = time.monotonic() + seconds
    while not (result := check()):
        assert time.monotonic() < deadline, f"waited {seconds:.0f} s for {what() if callable(what) else what}"
        await asyncio.sleep(step)
    return result
