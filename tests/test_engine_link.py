"""The engine across a process boundary: PoolServer <-> EngineLink / PoolRouter.

Both ends run in this process here (the channel is the same AF_UNIX socket either way); the
tests in test_media_workers.py run them in separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time

import numpy as np
import pytest

from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.errors import AudioFormatError, CallerError
from personaplex_demo.procs.engine_link import ENGINE_LOST, EngineLink
from personaplex_demo.procs.pool_router import PoolRouter
from personaplex_demo.procs.pool_server import PoolServer
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.headroom import WaitReason
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import CallEnded, PoolFullError

from .callers import wait_all_free
from .support.waiting import eventually

KEY = secrets.token_bytes(16)
TONE = (0.3 * 32767 * np.sin(2 * np.pi * 220 * np.arange(1920) / 24000)).astype(np.int16)


@pytest.fixture(scope="module")
def runtimes(tiny_cache_dir):
    return [build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir)) for _ in range(2)]


@contextlib.contextmanager
def served(runtime, address: str, name: str, **config):
    pool = SlotPool(runtime.engine, PoolConfig(**{"time_limit_seconds": 60, **config}))
    pool.start()
    server = PoolServer(pool, address, KEY, name=name).start()
    try:
        yield pool, server
    finally:
        server.close()
        pool.shutdown()


async def talk(call, seconds: float) -> list:
    """Push a tone in real time and collect the outputs."""
    outs = []
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        call.push_audio(TONE)
        n += 1
        while (out := await call.next_output(timeout=max(0.0, t0 + n * 0.08 - time.monotonic()))) is not None:
            outs.append(out)
    return outs


async def test_a_remote_call_talks_queues_refuses_and_frees_its_slot(runtimes, tmp_path):
    with served(runtimes[0], str(tmp_path / "e.sock"), "e0", max_queue=1) as (pool, _):
        engine = EngineLink(str(tmp_path / "e.sock"), KEY)
        assert (engine.name, engine.slots_total, engine.config.max_queue) == ("e0", 1, 1)
        with pytest.raises(CallerError, match="voice"):
            await engine.acquire("NOPE", "", SamplingParams())
        call = await engine.acquire("NATF2", "You enjoy having a good conversation.", SamplingParams(seed=3))
        waiting = await engine.acquire("NATM1", "", SamplingParams(seed=4))
        with pytest.raises(PoolFullError):
            await engine.acquire("NATM1", "", SamplingParams(seed=5))
        assert (waiting.state, waiting.queue_position) == ("queued", 1)
        await call.wait_live(10)
        assert call.slot == 0 and 59 < call.time_left() <= 60
        with pytest.raises(AudioFormatError):
            call.push_audio(np.zeros(100, np.int32))  # not 16-bit or float samples
        outs = await talk(call, 2.0)
        assert len(outs) >= 8 and all(o.pcm.shape == (1920,) and o.pcm.dtype == np.float32 for o in outs)
        assert "".join(o.text for o in outs)  # the tiny model babbles
        assert [o.tick for o in outs] == sorted(o.tick for o in outs)
        assert pool.snapshot().latency_p50_ms > 0  # the frames went through the pool's jitter buffer
        call.release()
        assert call.state == "ended" and call.end_reason == "hangup"
        with pytest.raises(CallEnded):
            await call.next_output(0.1)
        await waiting.wait_live(10)  # the freed slot goes to the queue's head
        assert waiting.slot == 0
        waiting.release()
        await wait_all_free(pool)
        engine.close()


async def test_a_lost_client_frees_its_slots_and_a_lost_engine_ends_its_calls(runtimes, tmp_path):
    address = str(tmp_path / "e.sock")
    with served(runtimes[0], address, "e0") as (pool, server):
        engine = EngineLink(address, KEY)
        call = await engine.acquire("NATF2", "", SamplingParams(seed=1))
        await call.wait_live(10)
        engine.close()  # as if its process had died
        await wait_all_free(pool)
        assert server.clients == 0

        engine = EngineLink(address, KEY)
        call = await engine.acquire("NATF2", "", SamplingParams(seed=1))
        await call.wait_live(10)
        server.close()  # the engine's end goes away
        with pytest.raises(CallEnded) as ended:
            await asyncio.wait_for(talk(call, 5.0), 5.0)
        assert ended.value.reason == ENGINE_LOST and not engine.alive


async def test_the_router_fills_free_slots_on_every_engine_before_queueing(runtimes, tmp_path):
    with contextlib.ExitStack() as stack:
        pools = [stack.enter_context(served(rt, str(tmp_path / f"e{i}.sock"), f"e{i}"))[0]
                 for i, rt in enumerate(runtimes)]
        router = PoolRouter([EngineLink(str(tmp_path / f"e{i}.sock"), KEY) for i in range(2)])
        assert router.slots_total == 2 and router.config.max_queue == 32  # one queue, the app's --max-queue
        ticks = []  # what /metrics's histograms are fed: every tick of every engine, with its latencies
        router.add_tick_listener(lambda seconds, latencies: ticks.append((seconds, latencies)))
        calls = [await router.acquire("NATF2", "", SamplingParams(seed=i)) for i in range(3)]
        assert sorted(c.engine.name for c in calls[:2]) == ["e0", "e1"]  # one on each engine
        assert calls[2].state == "queued"
        for call in calls[:2]:
            await call.wait_live(10)
        # The engines' figures arrive twice a second.
        await eventually(lambda: router.snapshot().slots_live == 2, "both engines' figures")
        room = router.snapshot()
        assert (room.slots_total, room.slots_live, room.queue_length) == (2, 2, 1)
        assert [s["name"] for s in router.engine_status()] == ["e0", "e1"]
        for call in calls[:2]:
            call.push_audio(TONE)
        await eventually(lambda: any(latencies for _, latencies in ticks), "ticks with their frames' latencies")
        assert all(seconds > 0 for seconds, _ in ticks)
        for call in calls:
            call.release()
        for pool in pools:
            await wait_all_free(pool)
        # Counts by reason add up across engines (and the router's own queue).
        await eventually(lambda: router.snapshot().calls_ended == {"hangup": 3}, "three hang-ups counted")
        router.close()


async def test_a_lagging_client_holds_new_calls_with_the_reason_until_it_recovers(tiny_cache_dir, tmp_path):
    runtime = build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir))
    address = str(tmp_path / "engine.sock")
    with served(runtime, address, "engine-0") as (pool, _):
        remote = EngineLink(address, KEY)
        try:
            first = await remote.acquire("NATF2", "")
            await first.wait_live(timeout=10)
            remote.report_media_lag(0.4)  # the client's event loop says it runs 400 ms late
            deadline = time.monotonic() + 5
            while pool.snapshot().media_lag_ms < 400 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert pool.snapshot().media_lag_ms == pytest.approx(400)
            second = await remote.acquire("NATM1", "")
            assert (second.state, second.queue_position, second.wait_reason) == ("queued", 1, WaitReason.CAPACITY)
            with pytest.raises(PoolFullError, match="capacity"):
                await remote.acquire("NATF2", "", queue=False)  # what the router asks first: no seat here
            remote.report_media_lag(0.0)
            await asyncio.gather(talk(first, 2.0), second.wait_live(timeout=10))
            assert second.state == "live" and second.wait_reason is None
            assert pool.snapshot().calls_held_back == 1
            first.release()
            second.release()
        finally:
            remote.close()


async def test_a_link_over_tcp_and_strangers_who_stall_or_lack_the_key_hold_up_nobody(runtimes):
    """An engine on another machine listens on TCP; a peer that connects and then says nothing (a
    half-open connection, a port scan) or has the wrong key is dropped, and the next client links
    at once. A client facing a server that never answers gives up within the handshake's limit."""
    import socket
    from multiprocessing.connection import AuthenticationError

    from personaplex_demo.procs.channel import open_link

    with served(runtimes[0], ("127.0.0.1", 0), "tcp") as (_, server):
        host, port = server.address
        assert port > 0
        stalled = socket.create_connection((host, port))  # connects, never answers the challenge
        with pytest.raises(AuthenticationError):
            EngineLink((host, port), b"not the key")
        t0 = time.monotonic()
        engine = EngineLink((host, port), KEY)
        assert time.monotonic() - t0 < 1.0 and engine.facts == {} and engine.name == "tcp"
        call = await engine.acquire("NATF2", "", SamplingParams(seed=1))
        await call.wait_live(10)
        assert await talk(call, 1.0)  # frames and outputs cross the TCP link
        call.release()
        engine.close()
        stalled.close()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never speaks
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            open_link(silent.getsockname()[:2], KEY, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
    finally:
        silent.close()


async def test_a_call_that_goes_live_before_the_server_relays_it_is_still_reported_live(runtimes, tmp_path):
    """The engine's relay loop is busy while the call prefills (a cached prompt takes a
    millisecond): the client, told "prefill" at the start, still hears that it went live."""
    with served(runtimes[0], str(tmp_path / "e.sock"), "busy") as (pool, server):
        engine = EngineLink(str(tmp_path / "e.sock"), KEY)
        try:
            held = threading.Event()
            server.loop.call_soon_threadsafe(held.wait, 10.0)  # holds the relay loop until released
            call = await engine.acquire("NATF2", "", SamplingParams(seed=1))
            assert call.state == "prefill"
            await eventually(lambda: pool.snapshot().slots_live == 1, "the call live on the engine")
            assert call.state == "prefill"  # its relay has not looked yet
            held.set()
            await call.wait_live(5)
            assert await talk(call, 0.5)
            call.release()
        finally:
            engine.close()


async def test_audio_pushed_between_ticks_waits_for_the_next_ticks_batch_and_that_tick_hears_it(runtimes, tmp_path):
    """A frame pushed 10 ms after an output leaves in a batch just before the engine's next tick
    (procs/tick_gather.py), not at once, and still reaches that tick: its output answers the frame,
    and the frame's age counts from the push, not from the batch."""
    with served(runtimes[0], str(tmp_path / "e.sock"), "e0") as (pool, _):
        engine = EngineLink(str(tmp_path / "e.sock"), KEY)
        try:
            call = await engine.acquire("NATF2", "", SamplingParams(seed=3))
            await call.wait_live(10)
            assert await call.next_output(timeout=2.0) is not None
            answered, shortfalls, pushes = 0, [], 20
            for _ in range(pushes):
                await asyncio.sleep(0.01)
                pushed = time.monotonic()
                call.push_audio(TONE)
                out = await call.next_output(timeout=2.0)
                assert out is not None, "no output within 2 s"
                if out.latency is not None:
                    answered += 1
                    # The engine's age of the frame against the time since the push (which adds the way back).
                    shortfalls.append(time.monotonic() - pushed - out.latency)
            assert engine.gather.batches >= pushes - 3  # held, and sent at the engine's planned time
            assert answered >= pushes - 3  # ...before the tick that took it (a busy host may miss a few)
            # Dated from the batch's arrival, the frames would look 30 ms or more younger than they are.
            assert np.median(shortfalls) < 0.02
            call.release()
        finally:
            engine.close()
