"""Real WebRTC round trips, in process: aiortc clients through fastrtc's `Stream.mount`."""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import time

import aioice.ice
import httpx
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack
from av import AudioFrame
from fastapi import FastAPI
from fastrtc import Stream

from personaplex_demo.handler import CallHandler
from personaplex_demo.loading import RuntimeOptions, build_runtime
from personaplex_demo.pool import PoolConfig, SlotPool

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def _loopback_ice(monkeypatch):
    # aioice skips 127.0.0.1; both peers live in this process, so loopback is the only route.
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4=True, use_ipv6=False: ["127.0.0.1"])


class ToneTrack(MediaStreamTrack):
    """A 48 kHz microphone playing a tone in real time, 20 ms per frame."""

    kind = "audio"

    def __init__(self, freq: float):
        super().__init__()
        self.freq, self.n, self.t0 = freq, 0, None

    async def recv(self) -> AudioFrame:
        if self.t0 is None:
            self.t0 = time.monotonic()
        await asyncio.sleep(max(0.0, self.t0 + self.n * 0.02 - time.monotonic()))
        t = (np.arange(960) + self.n * 960) / 48000
        pcm = (0.3 * 32767 * np.sin(2 * np.pi * self.freq * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
        self.n += 1
        return frame


class Client:
    def __init__(self, http: httpx.AsyncClient, stream: Stream, webrtc_id: str, persona: str, voice: str):
        self.http, self.stream, self.id = http, stream, webrtc_id
        self.args = [voice, persona, 0.7, 25, 0.8, 250, 7]
        self.pc = RTCPeerConnection()
        self.samples = 0
        self.energy = 0.0
        self.messages: list[str] = []

    async def connect(self, freq: float) -> dict:
        channel = self.pc.createDataChannel("text")

        @channel.on("message")
        def on_message(msg):
            self.messages.append(msg)
            if "send_input" in msg:
                self.stream.set_input(self.id, *self.args)

        @self.pc.on("track")
        def on_track(track):
            async def drain():
                while True:
                    try:
                        frame = await track.recv()
                    except Exception:
                        return
                    a = frame.to_ndarray().astype(np.float64)
                    self.samples += frame.samples
                    self.energy += float((a**2).sum())
            asyncio.ensure_future(drain())

        self.pc.addTrack(ToneTrack(freq))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        r = await self.http.post("/webrtc/offer", json={"sdp": self.pc.localDescription.sdp,
                                                        "type": "offer", "webrtc_id": self.id})
        answer = r.json()
        if "sdp" in answer:
            await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        return answer


async def collect_outputs(stream: Stream, webrtc_id: str, into: list, seconds: float) -> None:
    async def run():
        async for out in stream.output_stream(webrtc_id):
            into.append(out.args)
    try:
        await asyncio.wait_for(run(), seconds)
    except TimeoutError:
        pass


@pytest.fixture(scope="module")
def runtime(tiny_cache_dir):
    return build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir))


@contextlib.asynccontextmanager
async def serving(runtime, limit: int):
    """A started pool, a fastrtc Stream mounted on FastAPI, and an in-process HTTP client."""
    pool = SlotPool(runtime.engine, PoolConfig(time_limit_seconds=60))
    pool.start()
    stream = Stream(CallHandler(pool), modality="audio", mode="send-receive", concurrency_limit=limit)
    app = FastAPI()
    stream.mount(app)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            yield pool, stream, http
    finally:
        pool.shutdown()


async def test_two_callers_each_get_their_own_audio_and_transcript_and_hang_up_frees_slots(runtime):
    async with serving(runtime, 4) as (pool, stream, http):
        a = Client(http, stream, "caller-a", "You enjoy having a good conversation.", "NATF2")
        b = Client(http, stream, "caller-b", "You are a wise and friendly teacher.", "VARM1")
        await a.connect(220.0)
        await b.connect(330.0)
        outs_a, outs_b = [], []
        await asyncio.gather(collect_outputs(stream, "caller-a", outs_a, 6.0),
                             collect_outputs(stream, "caller-b", outs_b, 6.0))
        ha, hb = stream.handlers["caller-a"], stream.handlers["caller-b"]
        assert ha.call is not None and hb.call is not None and ha.call.slot != hb.call.slot
        assert ha.frames_in > 20 and hb.frames_in > 20  # 1920-sample frames assembled from the mic
        assert ha.frames_out > 20 and hb.frames_out > 20
        assert a.samples > 24000 and b.samples > 24000 and a.energy > 0 and b.energy > 0
        # Each caller's transcript comes from its own slot.
        ta = [o[0] for o in outs_a if o and o[0]]
        tb = [o[0] for o in outs_b if o and o[0]]
        assert ta and tb and ta[-1] != tb[-1]
        assert ta[-1] == ha.transcript[: len(ta[-1])] and tb[-1] == hb.transcript[: len(tb[-1])]
        assert any("fetch_output" in m for m in a.messages)
        await a.pc.close()
        await b.pc.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pool.snapshot().slots_free < 2:
            await asyncio.sleep(0.1)
        assert pool.snapshot().slots_free == 2
        assert "caller-a" not in stream.pcs and "caller-b" not in stream.pcs


async def test_third_caller_on_two_slots_waits_in_the_queue_then_gets_in(runtime):
    async with serving(runtime, 6) as (pool, stream, http):
        clients = [Client(http, stream, f"c{i}", "", "NATF2") for i in range(3)]
        for i, c in enumerate(clients):
            await c.connect(200.0 + 50 * i)
        outs = []
        await collect_outputs(stream, "c2", outs, 3.0)
        third = stream.handlers["c2"]
        assert third.call is not None and third.call.state == "queued" and third.call.queue_position == 1
        assert any("queue" in o[1] for o in outs if len(o) > 1), outs[-1:]
        await clients[0].pc.close()
        later = []
        await collect_outputs(stream, "c2", later, 4.0)
        assert third.call.state == "live"
        assert any(o[1].startswith("Live") for o in later if len(o) > 1)
        for c in clients[1:]:
            await c.pc.close()
