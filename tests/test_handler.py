"""The call handler and the page, against the real SlotPool and the tiny engine.

Real WebRTC round trips run in process: aiortc clients through fastrtc's `Stream.mount`, both
peers on 127.0.0.1. The rest drives a handler directly, as fastrtc would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import wave

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastrtc import AdditionalOutputs, CloseStream, Stream
from fastrtc.utils import Context, current_context

from personaplex_demo.engine.pcm import TickOutput
from personaplex_demo.rtc.patches import BoundedEventLog
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import END_MESSAGES, EndReason
from personaplex_demo.web.echo import WARNING as ECHO_WARNING
from personaplex_demo.web.handler import CallHandler, PageInputs, end_message
from personaplex_demo.web.recording import RecordingStore

from .callers import Caller, FeedbackTrack, ToneTrack, wait_all_free
from .test_pool import FakeEngine

NO_ICE_SERVERS = {"iceServers": []}  # loopback peers need no STUN (see Client)
pytestmark = pytest.mark.usefixtures("loopback_ice")


class Client(Caller):
    """A caller through `Stream.mount`'s endpoint; it answers "send_input" with `stream.set_input`."""

    def __init__(self, http: httpx.AsyncClient, stream: Stream, webrtc_id: str, persona: str, voice: str):
        super().__init__(webrtc_id, voice, persona)
        self.http, self.stream = http, stream

    def on_message(self, message: str) -> None:
        if "send_input" in message:
            self.stream.set_input(self.id, *self.args)

    async def send_offer(self, body: dict) -> dict:
        return (await self.http.post("/webrtc/offer", json=body)).json()

    async def connect(self, freq: float, mic=None) -> dict:
        return await self.offer(freq, mic)


async def collect_outputs(stream: Stream, webrtc_id: str, into: list, seconds: float) -> None:
    """The page updates of one connection for `seconds`, read from fastrtc's queue directly.

    Not `wait_for(<loop over stream.output_stream>)`: on Python 3.11 a cancellation that lands
    while the inner `wait_for(queue.get(), 0.1)` completes is swallowed, and with updates
    arriving every few ticks the outer `wait_for` then waits forever."""
    outputs = stream.additional_outputs[webrtc_id]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0 and not outputs.quit.is_set():
        try:
            out = await asyncio.wait_for(outputs.queue.get(), min(left, 0.2))
        except TimeoutError:
            continue
        into.append(out.args)


@pytest.fixture(scope="module")
def runtime(tiny_cache_dir):
    return build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir))


@contextlib.contextmanager
def started_pool(runtime, **config):
    pool = SlotPool(runtime.engine, PoolConfig(**config))
    pool.start()
    try:
        yield pool
    finally:
        pool.shutdown()


@contextlib.asynccontextmanager
async def serving(runtime, limit: int):
    """A started pool, a fastrtc Stream mounted on FastAPI, and an in-process HTTP client."""
    recordings = RecordingStore()
    # Admission by slot count: these tests follow calls through the handler and its queue on any
    # host; admission by headroom, which depends on the host's speed, has tests of its own.
    with started_pool(runtime, time_limit_seconds=60, admission="slots") as pool:
        stream = Stream(CallHandler(pool, recordings), modality="audio", mode="send-receive",
                        concurrency_limit=limit, server_rtc_configuration=NO_ICE_SERVERS)
        app = FastAPI()
        stream.mount(app)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                yield pool, stream, http
        finally:
            recordings.close()


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
        assert ha.packets_in > 20 and hb.packets_in > 20  # the microphone's packets, passed on to the room
        assert ha.figures.outputs > 20 and hb.figures.outputs > 20
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


class SpeakingEngine(FakeEngine):
    """The pool's engine API, speaking in syllables: noise whose loudness changes every 240 ms, as
    speech comes and goes. (The tiny model babbles at one steady level, which no loudness check can
    follow through two Opus codecs; real speech swings tens of dB.)"""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.rng = np.random.default_rng(3)
        self.levels = np.zeros(batch_size, np.float32)

    def step(self, pcm: np.ndarray) -> TickOutput:
        out = super().step(pcm)
        if self.steps % 3 == 0:
            self.levels = (0.3 * self.rng.uniform(0.0, 1.0, self.batch_size) ** 2).astype(np.float32)
        speech = self.levels[:, None] * self.rng.standard_normal(pcm.shape).astype(np.float32)
        return TickOutput(pcm=speech, text=out.text)


async def test_a_caller_whose_microphone_hears_the_agent_is_told_to_use_headphones():
    recordings = RecordingStore()
    pool = SlotPool(SpeakingEngine(3), PoolConfig(time_limit_seconds=60, admission="slots"))
    pool.start()
    stream = Stream(CallHandler(pool, recordings), modality="audio", mode="send-receive", concurrency_limit=4,
                    server_rtc_configuration=NO_ICE_SERVERS)
    app = FastAPI()
    stream.mount(app)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            # A laptop on speakers: the agent comes back 150 ms later at a third of its level. It
            # calls alone, so that on a slow host its played-back audio does not stutter for want
            # of CPU; it is given up to 20 s to be recognised (three checks in a row at one delay).
            echoing = Client(http, stream, "speakers", "", "NATF0")
            await echoing.connect(0.0, mic=FeedbackTrack(delay=0.15, gain=0.3))
            outs: list = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not stream.handlers["speakers"].echo.detected:
                await collect_outputs(stream, "speakers", outs, 1.0)
            await collect_outputs(stream, "speakers", outs, 1.5)  # the page update that says so
            warned = stream.handlers["speakers"]
            assert warned.echo.detected, warned.echo.summary()
            assert 0.1 <= warned.echo.delay_seconds <= 0.8, warned.echo.summary()
            assert any(o[1].startswith(ECHO_WARNING) for o in outs if len(o) > 1 and o[1]), outs[-3:]
            recording = warned.recording
            await echoing.pc.close()
            deadline = time.monotonic() + 10
            while not recording.finished and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            saved = json.loads(recording.files.transcript.read_text())
            assert saved["speaker_echo"]["detected"] and saved["speaker_echo"]["detected_at"]
            # A caller with a microphone of its own (a tone) and a silent one: neither is warned.
            singing = Client(http, stream, "tone", "", "NATM1")
            silent = Client(http, stream, "quiet", "", "NATF0")
            await singing.connect(330.0)
            await silent.connect(0.0, mic=ToneTrack(220.0, amplitude=0.0))
            await asyncio.gather(collect_outputs(stream, "tone", [], 12.0), collect_outputs(stream, "quiet", [], 12.0))
            clean, quiet = (stream.handlers[k] for k in ("tone", "quiet"))
            assert not clean.echo.detected and not quiet.echo.detected, (clean.echo.summary(), quiet.echo.summary())
            assert clean.figures.outputs > 100 and quiet.figures.outputs > 100
            for client in (singing, silent):
                await client.pc.close()
            await wait_all_free(pool, 5.0)
    finally:
        pool.shutdown()
        recordings.close()


# ---- one handler driven directly, as fastrtc drives it -------------------------------------------


class FakeChannel:
    """Stands in for the data channel: the handler only needs it to exist (and fastrtc to send)."""

    def __init__(self):
        self.sent: list[str] = []

    def send(self, message: str) -> None:
        self.sent.append(message)


def args(voice="NATF2", persona="You enjoy having a good conversation.", seed=3):
    return list(PageInputs(voice, persona, 0.7, 25, 0.8, 250, seed))


def in_a_connection() -> None:
    """What fastrtc sets up before it starts a handler: the connection's context."""
    current_context.set(Context(webrtc_id=f"direct-{uuid.uuid4().hex[:8]}"))


async def direct_call(pool: SlotPool, recordings: RecordingStore, call_args=None, **kw) -> CallHandler:
    h = CallHandler(pool, recordings, **kw).copy()
    h.set_channel(FakeChannel())
    h.set_args(list(call_args or args()))  # what Stream.set_input does when the page sends its inputs
    in_a_connection()
    await h.start_up()
    return h


async def feed_tone(h: CallHandler, seconds: float, freq: float = 220.0) -> None:
    """40 ms int16 chunks at 24 kHz, in real time, as fastrtc's resampler delivers them."""
    t0 = time.monotonic()
    for n in range(int(seconds / 0.04)):
        t = (np.arange(960) + n * 960) / 24000
        await h.receive((24000, (0.3 * 32767 * np.sin(2 * np.pi * freq * t)).astype(np.int16).reshape(1, -1)))
        await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.04 - time.monotonic()))


async def emit_until_closed(h: CallHandler, seconds: float) -> list:
    outs: list = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out = await h.emit()
        if out is not None:
            outs.append(out)
        if isinstance(out, CloseStream):
            break
    return outs


def page_updates(outs: list) -> list[tuple]:
    found = []
    for out in outs:
        extra = out[1] if isinstance(out, tuple) and isinstance(out[-1], AdditionalOutputs) else out
        if isinstance(extra, AdditionalOutputs):
            found.append(extra.args)
    return found


async def test_time_limit_ends_the_call_with_a_message_and_the_downloads(runtime, recordings):
    with started_pool(runtime, time_limit_seconds=1.5) as pool:
        h = await direct_call(pool, recordings)
        await h.call.wait_live(10)
        feeder = asyncio.ensure_future(feed_tone(h, 4.0))
        outs = await emit_until_closed(h, 6.0)
        feeder.cancel()
        assert isinstance(outs[-1], CloseStream) and "Time is up" in outs[-1].msg
        audio = [o[0] if isinstance(o[-1], AdditionalOutputs) else o for o in outs if isinstance(o, tuple)]
        assert len(audio) >= 10 and all(a[0] == 24000 and a[1].shape == (1920,) for a in audio)
        updates = page_updates(outs)
        assert any(u[1].startswith("Live") and "left" in u[1] for u in updates)
        transcript, status, call_id, files, figures = updates[-1]
        assert status.startswith("Call ended: Time is up") and call_id == h.call_id
        # This call's own figures stay on the page after the end.
        assert figures.startswith("**This call** first sound after") and "round trip" in figures, figures
        assert transcript == h.transcript and transcript  # the tiny model babbles text every few ticks
        wav_path, json_path = files
        with wave.open(wav_path) as w:
            assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (2, 24000, 2)
            stereo = np.frombuffer(w.readframes(w.getnframes()), np.int16).reshape(-1, 2).astype(np.float64)
        assert stereo.shape[0] >= 1.2 * 24000
        assert np.sqrt((stereo[:, 0] ** 2).mean()) > 3000  # the caller's tone, left
        assert stereo[:, 1].any()  # the agent, right
        meta = json.loads(open(json_path).read())
        assert meta["end_reason"] == "time_limit" and meta["voice"] == "NATF2" and meta["text"] == transcript
        assert meta["channels"] == {"left": "caller", "right": "agent"} and meta["segments"]
        fig = meta["call_figures"]
        assert list(fig["first_audio_parts_seconds"]) == ["connect", "inputs", "room", "first_tick", "first_sound"]
        assert 0 < fig["first_audio_seconds"] == pytest.approx(sum(fig["first_audio_parts_seconds"].values()), abs=0.01)
        assert fig["latency_ms"]["answers"] >= 10 and 0 < fig["latency_ms"]["p50"] <= fig["latency_ms"]["p95"]
        assert fig["outputs"] >= len(audio) and fig["queued"] is False and fig["packets"] is None
        await wait_all_free(pool)


async def test_a_random_seed_is_drawn_per_call_and_recorded(runtime, recordings):
    with started_pool(runtime) as pool:
        calls = [await direct_call(pool, recordings, args(seed=-1)) for _ in range(2)]
        seeds = [recordings.get(h.call_id).meta["sampling"]["seed"] for h in calls]
        fixed = await direct_call(pool, recordings, args(seed=7))
        assert recordings.get(fixed.call_id).meta["sampling"]["seed"] == 7
        assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds) and seeds[0] != seeds[1]
        for h in (*calls, fixed):
            h.shutdown()
        await wait_all_free(pool)


async def test_a_full_room_refuses_with_a_clear_message(runtime, recordings):
    with started_pool(runtime, max_queue=0) as pool:
        first = await direct_call(pool, recordings)
        second = await direct_call(pool, recordings)
        third = await direct_call(pool, recordings)
        assert third.call is None
        outs = await emit_until_closed(third, 2.0)
        assert isinstance(outs[-1], CloseStream) and "All 2 conversation slots are busy" in outs[-1].msg
        assert page_updates(outs)[-1][1].startswith("Call ended: All 2 conversation slots are busy")
        first.shutdown()
        second.shutdown()
        await wait_all_free(pool)


async def test_the_room_ends_a_queued_page_call_at_the_wait_limit_whatever_audio_arrives(runtime, recordings):
    """The queue's rules are the room's (PoolConfig): the page only shows what the room decided. A
    waiting page holds its microphone (web/mic_hold.py), so audio that still arrives while it
    waits, or stops arriving, says nothing of the caller: the connection does (ICE consent)."""
    with started_pool(runtime, max_wait_seconds=1.5, idle_release_seconds=10) as pool:
        holders = [await direct_call(pool, recordings) for _ in range(2)]
        patient = await direct_call(pool, recordings)  # its audio keeps arriving
        paused = await direct_call(pool, recordings)  # a moment of audio, then none
        silent = await direct_call(pool, recordings)  # never any audio
        waiting = (patient, paused, silent)
        assert [(h.call.state, h.call.queue_position) for h in waiting] == [("queued", 1), ("queued", 2), ("queued", 3)]
        assert all(h.mic.held for h in waiting)
        feeders = [asyncio.ensure_future(feed_tone(patient, 3.0)), asyncio.ensure_future(feed_tone(paused, 0.3))]
        outs = await asyncio.gather(*(emit_until_closed(h, 4.0) for h in waiting))
        for feeder in feeders:
            feeder.cancel()
        assert "number 1 in the queue" in page_updates(outs[0])[0][1]
        for out in outs:
            assert isinstance(out[-1], CloseStream) and "no place in the room" in out[-1].msg
        assert [h.call.end_reason for h in waiting] == ["queue_timeout"] * 3
        assert pool.snapshot().queue_length == 0
        for h in holders:
            h.shutdown()
        await wait_all_free(pool)


def test_the_page_is_told_once_to_hold_its_microphone_and_once_to_send_it_again():
    from personaplex_demo.web.mic_hold import HOLD, SEND, MicHold

    class Channel:
        sent: list[str] = []

        def send(self, message: str) -> None:
            self.sent.append(json.loads(message)["data"])

    mic, channel = MicHold(), Channel()
    for held in (False, True, True, False, False):
        mic.set(held, channel, None, None)
    assert channel.sent == [HOLD, SEND]


# ---- the page ---------------------------------------------------------------------------------


async def test_the_page_wiring_status_endpoint_and_downloads(runtime, recordings):
    import gradio as gr
    from fastrtc import WebRTC

    from personaplex_demo.web.page import PageOptions, build_ui, status_routes

    pool = SlotPool(runtime.engine, PoolConfig(max_queue=3))
    demo = build_ui(runtime, pool, PageOptions(), recordings)
    rtc = next(b for b in demo.blocks.values() if isinstance(b, WebRTC))
    assert rtc.time_limit is None  # the pool counts the limit from going live, not from connecting
    assert rtc.concurrency_limit == pool.slots_total + 3 + 2
    assert isinstance(demo._queue.event_analytics, BoundedEventLog)  # every page's timer adds events
    by_event = {}
    for fn in demo.fns.values():
        for _, event in fn.targets:
            by_event.setdefault(event, []).append(fn)
    # Every caller's page must update, not only the first one's (Gradio's default limit is 1).
    assert all(fn.concurrency_limit is None for fn in by_event["state_change"] + by_event["stop_recording"])
    banner = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "banner")
    assert "tiny offline model" in banner.value
    voice = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "voice")
    assert voice.value == "NATF2" and len(voice.choices) == 18
    stats = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "stats")
    assert "appear once a call is live" in stats.value  # no 0 ms figures before anything was measured

    # After Stop the page waits for the recording and shows both downloads.
    rec = recordings.start("call-1", {"voice": "NATF2"})
    rec.add_caller(np.full(1920, 1000, np.int16))
    rec.add_agent(np.zeros(1920, np.float32), "hello")
    asyncio.get_running_loop().call_later(0.2, rec.finish, "hangup")
    status, wav_update, json_update = await by_event["stop_recording"][0].fn("call-1")
    assert status.startswith("Call ended") and wav_update["visible"] and wav_update["value"].endswith(".wav")
    assert json.loads(open(json_update["value"]).read())["text"] == "hello"

    # A late page trigger for a call that is over returns at once, with its final update if any.
    relay = by_event["state_change"][0].fn
    got = [u async for u in relay("gone")]
    assert len(got) == 1 and all(isinstance(u, type(gr.skip())) for u in got[0])
    rtc.event_handler.final_updates.put("gone-2", ("words", "Call ended: Time is up", "cid", ("/x/a.wav", "/x/a.json"),
                                "**This call** first sound after 0.40 s"))
    got = [u async for u in relay("gone-2")]
    # Plain values only (each gr.update or gr.skip makes Gradio rebuild a component); the ended
    # call's id is what brings up its downloads, and the call's figures stay.
    assert got == [("words", "Call ended: Time is up", "cid", "cid", "**This call** first sound after 0.40 s")]
    assert rtc.event_handler.final_updates.pop("gone-2") is None
    show_downloads = by_event["change"][[fn.fn.__name__ for fn in by_event["change"]].index("show_downloads")].fn
    wav_update, json_update = await show_downloads("call-1")
    assert wav_update["visible"] and wav_update["value"].endswith(".wav") and json_update["visible"]
    assert all(u == gr.skip() for u in await show_downloads("no-such-call"))

    app = gr.routes.App.create_app(demo, app_kwargs={"routes": status_routes(runtime, pool)})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.get("/api/status")
    assert r.status_code == 200
    body = r.json()
    assert body["tiny"] is True and body["slots_total"] == 2 and body["slots_free"] == 2
    assert {"queue_length", "tick_p50_ms", "tick_p99_ms", "realtime_factor", "latency_p50_ms"} <= set(body)


def test_a_failure_reads_as_what_failed_and_what_to_do():
    from personaplex_demo.procs.engine_link import ENGINE_LOST

    assert end_message(EndReason.error("the engine on 10.0.0.7 stopped")) == (
        "The call ended: the engine on 10.0.0.7 stopped. Please press Record to call again.")
    assert end_message(ENGINE_LOST).startswith("The call ended: the engine process stopped. Please")
    assert end_message(EndReason.SHUTDOWN) == END_MESSAGES[EndReason.SHUTDOWN]
    assert end_message("error") == "The call ended: error. Please press Record to call again."
