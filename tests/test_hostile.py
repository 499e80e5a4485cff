"""Hostile and broken clients: each gets a specific answer, nothing leaks, others keep talking."""

from __future__ import annotations

import asyncio
import logging

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastrtc import CloseStream, Stream

from personaplex_demo.logs import install_secret_filter
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.web.handler import CallHandler, PageInputs
from personaplex_demo.web.recording import RecordingStore

from .test_handler import in_a_connection

ARGS = ["__webrtc_value__", "id", *PageInputs("NATF2", "", 0.7, 25, 0.8, 250, 1)]


@pytest.fixture(scope="module")
def runtime(tiny_cache_dir):
    return build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir))


@pytest.fixture
def pool(runtime):
    p = SlotPool(runtime.engine, PoolConfig(time_limit_seconds=30))
    p.start()
    yield p
    p.shutdown()


async def started_handler(pool: SlotPool, recordings: RecordingStore, args=ARGS) -> CallHandler:
    h = CallHandler(pool, recordings).copy()

    async def no_args():
        return None

    h.wait_for_args = no_args
    h.latest_args = list(args)
    in_a_connection()
    await h.start_up()
    return h


async def drain_until(h: CallHandler, predicate, seconds: float = 5.0):
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        out = await h.emit()
        if predicate(out):
            return out
    return None


async def test_malformed_offers_are_refused_without_a_slot(pool, recordings):
    stream = Stream(CallHandler(pool, recordings), modality="audio", mode="send-receive", concurrency_limit=4,
                    server_rtc_configuration={"iceServers": []})
    app = FastAPI()
    stream.mount(app)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post("/webrtc/offer", json={"sdp": "v=0 garbage", "type": "offer", "webrtc_id": "x"})
        assert r.status_code >= 400 or r.json().get("status") == "failed"  # aiortc rejects the SDP
        r = await http.post("/webrtc/offer", json={"type": "offer"})
        assert r.status_code == 422
    # fastrtc may keep its bookkeeping entry, but no call was admitted and no slot is held.
    assert pool.snapshot().slots_free == 2
    assert getattr(stream.handlers.get("x"), "call", None) is None


async def test_unknown_voice_and_oversize_persona_end_the_call_with_the_reason(pool, recordings):
    h = await started_handler(pool, recordings, ARGS[:2] + ["../../x"] + ARGS[3:])
    out = await h.emit()
    assert isinstance(out, CloseStream) and "NATF2" in out.msg
    h = await started_handler(pool, recordings, ARGS[:3] + ["word " * 700] + ARGS[4:])
    out = await h.emit()
    assert isinstance(out, CloseStream) and "tokens" in out.msg
    assert pool.snapshot().slots_free == 2


async def test_any_rate_and_channels_reach_the_room_as_24_khz_mono(pool, recordings):
    # The handler's decoded frames pass its resampler (rtc/audio.py) before `receive`:
    # a browser's 48 kHz stereo comes out as the room's 24 kHz 16-bit mono, and the call goes on.
    import av

    h = await started_handler(pool, recordings)
    await h.call.wait_live(10)
    frame = av.AudioFrame.from_ndarray(np.zeros((1, 2 * 960), np.int16), format="s16", layout="stereo")
    frame.sample_rate, frame.pts = 48000, 0
    out = [f for _ in range(3) for f in h.resample(frame)]
    assert out and {(f.sample_rate, f.layout.name, f.format.name) for f in out} == {(24000, "mono", "s16")}
    for f in out:
        await h.receive((f.sample_rate, f.to_ndarray()))
    assert await drain_until(h, lambda o: isinstance(o, tuple)) is not None
    h.shutdown()


def test_secrets_never_reach_the_logs(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue123")
    log = logging.getLogger("personaplex_demo.test")
    handler = logging.Handler()
    records = []
    handler.emit = lambda r: records.append(r.getMessage())
    log.addHandler(handler)
    install_secret_filter(log)  # what app.py does for the root logger's handlers
    log.warning("download failed with token %s", "hf_supersecretvalue123")
    log.removeHandler(handler)
    assert records and all("supersecret" not in m for m in records)
