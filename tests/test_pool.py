"""SlotPool: admission, queue, pacing, limits, metrics and failures, against a fake engine.

Most tests drive the ticker by hand (`tick_once`, or `iterate` with a FakeClock), so every time they
check is exact. A few use the real clock and the ticker thread for the cross-thread paths."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from personaplex_demo.engine.pcm import SamplingParams, TickOutput
from personaplex_demo.errors import AudioFormatError, CallerError, UnknownVoiceError
from personaplex_demo.serving.call import Call
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pacing import RealClock
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import CallEnded, PoolClosedError, PoolFullError, SlotOutput

from .support.fake_clock import FakeClock

FRAME = 1920


class FakeEngine:
    """Echo engine with the LockstepEngine thread API. Output row `s` is: [0] = s, [1] = input
    sample 0, [2] = step number, so tests can check every output's caller and input frame."""

    def __init__(
        self,
        batch_size: int = 2,
        clock: FakeClock | RealClock | None = None,
        step_seconds: float = 0.0,
        prefill_seconds: float = 0.0,
    ) -> None:
        self.batch_size = batch_size
        self.frame_size = FRAME
        self.max_persona_tokens = 64
        self.clock = clock or RealClock()
        self.step_seconds = step_seconds
        self.step_delays: dict[int, float] = {}  # step number -> extra seconds that step takes
        self.prefill_seconds = prefill_seconds
        self.fail_step: Exception | None = None  # raised by the next step, once
        self.fail_start: Exception | None = None  # raised by the next start_session, once
        self.prefill_gate: threading.Event | None = None  # start_session waits on it when set
        self.prefill_entered = threading.Event()
        self.on_step: Callable[[int], None] | None = None
        self.active: set[int] = set()
        self.started: list[int] = []
        self.ended: list[int] = []
        self.steps = 0
        self.step_times: list[float] = []
        self.inputs: list[np.ndarray] = []  # every step's input, [batch, FRAME]
        self.threads: set[int] = set()
        self.cached: set[tuple[str, str]] | None = None  # None: every prompt is in the prefix cache

    def bucket(self, rows: int) -> int:
        """The batch a tick of `rows` steps: the rows themselves (this engine has no buckets)."""
        return rows

    @property
    def voice_names(self) -> list[str]:
        return ["NATF0", "NATM1"]

    def prefix_cached(self, voice: str, persona: str) -> bool:
        return self.cached is None or (voice, persona) in self.cached

    def validate_request(self, voice: str, persona: str, sampling: SamplingParams) -> None:
        if voice not in self.voice_names:
            raise UnknownVoiceError(f"unknown voice {voice!r}; choose one of {self.voice_names}")

    def start_session(self, slot: int, voice: str, persona: str, sampling: SamplingParams) -> None:
        self.threads.add(threading.get_ident())
        self.prefill_entered.set()
        if self.prefill_gate is not None:
            assert self.prefill_gate.wait(5)
        self.clock.sleep(self.prefill_seconds)
        if self.fail_start is not None:
            exc, self.fail_start = self.fail_start, None
            raise exc
        self.active.add(slot)
        self.started.append(slot)
        if self.cached is not None:
            self.cached.add((voice, persona))

    def end_session(self, slot: int) -> None:
        self.threads.add(threading.get_ident())
        self.active.discard(slot)
        self.ended.append(slot)

    def step(self, pcm: np.ndarray) -> TickOutput:
        self.threads.add(threading.get_ident())
        assert pcm.shape == (self.batch_size, FRAME) and pcm.dtype == np.float32
        self.steps += 1
        self.step_times.append(self.clock.monotonic())
        self.inputs.append(pcm.copy())
        if self.on_step is not None:
            self.on_step(self.steps)
        self.clock.sleep(self.step_seconds + self.step_delays.get(self.steps, 0.0))
        if self.fail_step is not None:
            exc, self.fail_step = self.fail_step, None
            raise exc
        out = np.zeros_like(pcm)
        text = [""] * self.batch_size
        for slot in self.active:
            out[slot, 0] = slot
            out[slot, 1] = pcm[slot, 0]
            out[slot, 2] = self.steps
            text[slot] = f"{slot}:{self.steps}"
        return TickOutput(pcm=out, text=text)


def frame(value: float) -> np.ndarray:
    return np.full(FRAME, value, dtype=np.float32)


def run_for(pool: SlotPool, iterations: int) -> None:
    """The ticker loop, for a given number of turns (on this thread, with the pool's clock)."""
    for _ in range(iterations):
        pool.ticker.iterate()


def make(batch: int = 2, step_seconds: float = 0.0, **config) -> tuple[SlotPool, FakeEngine, FakeClock]:
    clock = FakeClock()
    engine = FakeEngine(batch, clock, step_seconds=step_seconds)
    return SlotPool(engine, PoolConfig(**config), clock), engine, clock


def drain(call: Call) -> list[SlotOutput]:
    """Every output waiting on `call`, without waiting for more."""

    async def go() -> list[SlotOutput]:
        got = []
        try:
            while (out := await call.next_output(0)) is not None:
                got.append(out)
        except CallEnded:
            pass
        return got

    return asyncio.run(go())


def live_call(pool: SlotPool, voice: str = "NATF0") -> Call:
    call = pool.admit(voice, "You are a helpful caller.")
    pool.ticker.tick_once()
    assert call.state == "live"
    return call


# ---- admission and queue ------------------------------------------------------------------------


def test_admission_order_prefill_then_live_and_queue_takes_freed_slot():
    pool, engine, _ = make(batch=2)
    a, b, c = (pool.admit("NATF0", "p") for _ in range(3))
    assert (a.state, a.slot, b.state, b.slot) == ("prefill", 0, "prefill", 1)
    assert (c.state, c.slot, c.queue_position) == ("queued", None, 1)
    m = pool.snapshot()
    assert (m.slots_prefill, m.slots_live, m.queue_length) == (2, 0, 1)

    pool.ticker.tick_once()  # no live slot yet: no step, but both prefills run
    assert engine.steps == 0 and engine.started == [0, 1]
    assert (a.state, b.state, c.state) == ("live", "live", "queued")

    a.release()
    assert a.state == "ended" and a.end_reason == "hangup" and c.state == "queued"
    pool.ticker.tick_once()  # frees slot 0 (end_session), hands it to c, prefills c
    assert engine.ended == [0]
    assert (c.state, c.slot, c.queue_position) == ("live", 0, None)
    assert engine.started == [0, 1, 0]


def test_at_most_one_prompt_is_computed_per_gap_between_ticks_and_cached_ones_ride_along():
    pool, engine, _ = make(batch=4)
    engine.cached = {("NATF0", "known")}
    cold = [pool.admit("NATF0", f"new {i}") for i in range(2)]
    cold.append(pool.admit("NATM1", "known"))  # the same persona with another voice: cold too
    cached = pool.admit("NATF0", "known")
    pool.ticker.tick_once()
    # The first cold prompt runs; the others wait for the next gaps, the cached one goes at once.
    assert [c.state for c in (*cold, cached)] == ["live", "prefill", "prefill", "live"]
    assert engine.started == [0, 3]
    pool.ticker.tick_once()
    assert [c.state for c in cold] == ["live", "live", "prefill"] and engine.started == [0, 3, 1]
    pool.ticker.tick_once()
    assert all(c.state == "live" for c in cold) and engine.started == [0, 3, 1, 2]


def test_queue_positions_follow_callers_ahead_leaving():
    pool, _, _ = make(batch=1)
    head = live_call(pool)
    q1, q2, q3 = (pool.admit("NATF0", "p") for _ in range(3))
    assert [q.queue_position for q in (q1, q2, q3)] == [1, 2, 3]

    q2.release("cancelled")
    assert (q2.state, q2.end_reason, q2.queue_position) == ("ended", "cancelled", None)
    assert [q1.queue_position, q3.queue_position] == [1, 2]
    assert pool.snapshot().queue_length == 2

    head.release()
    pool.ticker.tick_once()
    assert (q1.state, q1.slot) == ("live", 0)
    assert q3.queue_position == 1 and pool.snapshot().queue_length == 1


def test_burst_of_50_connects_against_4_slots_and_a_queue_of_32():
    pool, _, _ = make(batch=4, max_queue=32)
    admitted, refused = [], []
    for _ in range(50):
        try:
            admitted.append(pool.admit("NATM1", "p"))
        except PoolFullError as exc:
            refused.append(str(exc))
    assert [c.state for c in admitted[:4]] == ["prefill"] * 4
    assert [c.queue_position for c in admitted[4:]] == list(range(1, 33))
    assert len(refused) == 14
    assert refused[0] == "all 4 slots busy and the queue of 32 is full; try again in a minute"
    m = pool.snapshot()
    assert (m.slots_prefill, m.queue_length, m.calls_refused) == (4, 32, 14)


def test_acquire_without_queueing_takes_a_free_slot_or_refuses_without_counting_a_refusal():
    pool, _, _ = make(batch=1, max_queue=4)
    first = pool.admit("NATF0", "p", queue=False)
    assert first.state == "prefill"
    with pytest.raises(PoolFullError, match="all 1 slots busy"):
        pool.admit("NATF0", "p", queue=False)
    m = pool.snapshot()
    assert (m.queue_length, m.calls_refused) == (0, 0)  # a probe for another engine, not a refusal


def test_caller_error_from_validation_takes_nothing():
    pool, _, _ = make()
    with pytest.raises(UnknownVoiceError) as info:
        pool.admit("NOPE", "p")
    assert isinstance(info.value, CallerError)
    m = pool.snapshot()
    assert (m.slots_prefill, m.queue_length) == (0, 0)


# ---- the ticker ---------------------------------------------------------------------------------


def test_routing_latency_and_underruns():
    pool, engine, clock = make(batch=3, step_seconds=0.005)
    a, b, c = (pool.admit("NATF0", "p") for _ in range(3))
    pool.ticker.tick_once()  # all three prefilled and live
    clock.advance(0.010)
    a.push_audio(frame(7))
    c.push_audio(frame(9))
    clock.advance(0.020)
    pool.ticker.tick_once()

    (oa,), (ob,), (oc,) = drain(a), drain(b), drain(c)
    assert (oa.pcm[0], oa.pcm[1], oa.text, oa.tick) == (0, 7, "0:1", 1)
    assert (ob.pcm[0], ob.pcm[1]) == (1, 0)  # b sent nothing yet: silence, not an underrun
    assert (oc.pcm[0], oc.pcm[1]) == (2, 9)
    assert oa.pcm.dtype == np.float32 and oa.pcm.shape == (FRAME,)
    m = pool.snapshot()
    assert m.latency_p50_ms == pytest.approx(25.0)  # 20 ms waiting for the tick + 5 ms step
    assert m.added_latency_p50_ms == pytest.approx(20.0)
    assert m.underruns == 0 and m.ticks == 1

    pool.ticker.tick_once()  # a and c have started sending and have no frame now: underruns
    assert pool.snapshot().underruns == 2
    assert [x.counters.underruns for x in (a, b, c)] == [1, 0, 1]
    assert [len(drain(x)) for x in (a, b, c)] == [1, 1, 1]  # silence in, still audio out


def test_audio_a_client_held_counts_from_its_arrival_there_and_outputs_carry_the_next_planned_tick():
    pool, engine, clock = make(batch=1, step_seconds=0.005)
    a = pool.admit("NATF0", "p")
    run_for(pool, 2)  # prefilled and live; steps at 0.02 and 0.10 on the schedule
    clock.advance(0.010)
    pushed = clock.monotonic()
    a.push_audio(frame(7), held=0.030)  # it reached the client 30 ms before it reached the pool
    run_for(pool, 1)
    *_, out = drain(a)
    step = engine.step_times[-1]
    assert out.pcm[1] == 7 and out.latency == pytest.approx(step + 0.005 - (pushed - 0.030))  # 5 ms: the step
    assert out.next_take == pytest.approx(step + 0.08)  # the schedule as it stands: the next step is due then
    run_for(pool, 1)
    assert engine.step_times[-1] == pytest.approx(out.next_take)


def test_input_backlog_drops_the_oldest_frames():
    pool, _, _ = make(batch=1, input_buffer_seconds=2.0)
    a = live_call(pool)
    for k in range(30):
        a.push_audio(frame(k))
    assert pool.snapshot().input_drops == 5 and a.counters.input_drops == 5
    pool.ticker.tick_once()
    pool.ticker.tick_once()
    assert [o.pcm[1] for o in drain(a)] == [5, 6]


def test_push_audio_formats_and_states():
    pool, _, _ = make(batch=1)
    early = pool.admit("NATF0", "p")
    early.push_audio(frame(1))  # not live yet: dropped, not an error
    assert early.counters.frames_pushed == 0
    pool.ticker.tick_once()

    early.push_audio(np.full(FRAME, 16384, dtype=np.int16))
    pool.ticker.tick_once()
    (out,) = drain(early)
    assert out.pcm[1] == pytest.approx(0.5)
    with pytest.raises(AudioFormatError, match="1 to 24000 samples"):
        early.push_audio(np.zeros(0, dtype=np.int16))
    with pytest.raises(AudioFormatError, match="1 to 24000 samples"):
        early.push_audio(np.zeros(24001, dtype=np.int16))
    with pytest.raises(AudioFormatError, match="mono"):
        early.push_audio(np.zeros((2, 960), dtype=np.int16))
    with pytest.raises(AudioFormatError, match="int16 or float32"):
        early.push_audio(np.zeros(FRAME, dtype=np.int32))
    early.push_audio(np.zeros((1, FRAME), dtype=np.float64))  # any float, any one-channel shape
    early.push_audio(np.zeros(7, dtype=np.int16))  # any length: the room cuts the frames
    assert early.counters.frames_pushed == 3


def test_slow_consumer_loses_oldest_outputs_and_never_blocks_the_ticker():
    pool, engine, clock = make(batch=1, output_queue_frames=50)
    a = live_call(pool)
    for k in range(60):
        a.push_audio(frame(k))
        pool.ticker.tick_once()
        clock.advance(0.08)
    assert engine.steps == 60
    outs = drain(a)
    assert len(outs) == 50 and outs[0].tick == 11 and outs[-1].tick == 60
    assert a.counters.output_drops == 10 and pool.snapshot().output_drops == 10


def test_cadence_idle_sleep_and_summary_log(caplog):
    pool, engine, clock = make(batch=2, summary_log_seconds=0.3)
    run_for(pool, 3)  # nothing to do: three 20 ms naps, no step
    assert clock.sleeps == pytest.approx([0.02] * 3) and engine.steps == 0

    t0 = clock.monotonic()
    a = pool.admit("NATF0", "p")
    with caplog.at_level(logging.INFO, logger="personaplex_demo.serving.ticker"):
        run_for(pool, 6)  # prefill at t0, then one step every 80 ms
    assert a.state == "live"
    # The tick of the prefill stepped nobody, so it kept no schedule: the first step comes one idle
    # nap (20 ms) after it, not a whole tick later; from then on one every 80 ms.
    assert [t - t0 for t in engine.step_times] == pytest.approx([0.02, 0.10, 0.18, 0.26, 0.34])
    assert pool.snapshot().overruns == 0
    assert any("slot pool: live 1/2" in r.getMessage() for r in caplog.records)

    a.release()
    clock.sleeps.clear()
    run_for(pool, 3)  # frees the slot, then naps
    assert engine.ended == [0] and engine.steps == 5
    assert clock.sleeps[-2:] == pytest.approx([0.02, 0.02])


def test_a_call_joining_a_live_room_keeps_the_schedule():
    pool, engine, clock = make(batch=2)
    pool.admit("NATF0", "p")
    run_for(pool, 4)
    b = pool.admit("NATM1", "q")  # seated and prefilled in the gap after the next step
    run_for(pool, 4)
    assert b.state == "live"
    # The others' schedule holds: every step 80 ms after the previous one, none squeezed in.
    assert np.diff(engine.step_times) == pytest.approx([0.08] * (len(engine.step_times) - 1))


def test_overrun_catches_up_without_a_burst():
    pool, engine, clock = make(batch=1)
    engine.step_delays[3] = 0.2  # the third step takes 200 ms
    call = pool.admit("NATF0", "p")
    run_for(pool, 8)
    # Steps are due every 80 ms from 0.02. The slow step ends at 0.38, so the steps due at 0.26, 0.34
    # and 0.42 run at 0.38, 0.42 and 0.46 (40 ms apart, no burst); the one due at 0.50 is on time again.
    assert engine.step_times == pytest.approx([0.02, 0.10, 0.18, 0.38, 0.42, 0.46, 0.50])
    # Each output says when the next step comes: the catch-up steps' too. The slow step's own could
    # not know it would overrun (0.26, the schedule's).
    assert [out.next_take for out in drain(call)] == pytest.approx([0.10, 0.18, 0.26, 0.42, 0.46, 0.50, 0.58])
    m = pool.snapshot()
    assert (m.overruns, m.resyncs) == (2, 0)
    assert m.tick_p50_ms == 0.0 and m.tick_p99_ms > 150.0  # 6 instant ticks and one of 200 ms


def test_far_behind_resynchronises_and_cuts_the_backlog():
    pool, engine, clock = make(batch=1)
    engine.step_delays[3] = 1.5
    a = pool.admit("NATF0", "p")

    def feed(step: int) -> None:  # the caller keeps sending while the ticker is stuck
        if step == 3:
            for k in range(20):
                a.push_audio(frame(k))

    engine.on_step = feed
    run_for(pool, 6)
    assert engine.step_times == pytest.approx([0.02, 0.10, 0.18, 1.68, 1.76])
    m = pool.snapshot()
    assert (m.overruns, m.resyncs, m.input_drops) == (1, 1, 19)
    assert [o.pcm[1] for o in drain(a)][-2:] == [19, 0]  # the newest frame was kept, then nothing came


# ---- limits -------------------------------------------------------------------------------------


def test_idle_release_after_two_seconds_without_input():
    pool, engine, clock = make(batch=1, idle_release_seconds=2.0)
    a = live_call(pool)
    clock.advance(1.9)
    pool.ticker.tick_once()
    a.push_audio(frame(1))  # t = 1.9
    clock.advance(1.99)
    pool.ticker.tick_once()
    assert a.state == "live"
    clock.advance(0.02)  # 2.01 s since the last frame
    pool.ticker.tick_once()
    assert (a.state, a.end_reason) == ("ended", "idle")
    assert engine.ended == [0] and pool.snapshot().slots_live == 0


def test_time_limit_counts_from_going_live():
    pool, engine, clock = make(batch=1, time_limit_seconds=5.0, idle_release_seconds=100.0)
    queued_for = pool.admit("NATF0", "p")
    clock.advance(3.0)  # prefill waits: does not count against the limit
    assert queued_for.time_left() is None
    pool.ticker.tick_once()
    clock.advance(4.99)
    assert queued_for.time_left() == pytest.approx(0.01)
    pool.ticker.tick_once()
    assert queued_for.state == "live"
    clock.advance(0.02)
    pool.ticker.tick_once()
    assert (queued_for.state, queued_for.end_reason) == ("ended", "time_limit")
    assert queued_for.time_left() is None and engine.ended == [0]

    unlimited = make(batch=1, time_limit_seconds=None)[0]
    assert live_call(unlimited).time_left() is None


# ---- failures and shutdown ----------------------------------------------------------------------


def test_exception_in_one_tick_ends_those_calls_and_the_pool_keeps_serving(caplog):
    pool, engine, _ = make(batch=2)
    a, b = live_call(pool), live_call(pool)
    waiting = pool.admit("NATF0", "p")
    engine.fail_step = RuntimeError("boom")
    with caplog.at_level(logging.ERROR, logger="personaplex_demo.serving.ticker"):
        pool.ticker.tick_once()
    assert a.end_reason == b.end_reason == "error: RuntimeError: boom"
    assert sorted(engine.ended) == [0, 1]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "personaplex_demo.serving.ticker"]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert (waiting.state, waiting.slot) == ("live", 0)  # the freed slot went to the queue's head

    waiting.push_audio(frame(3))
    pool.ticker.tick_once()
    (out,) = drain(waiting)
    assert out.pcm[1] == 3
    assert pool.snapshot().engine_errors == 1


def test_exception_in_start_session_ends_only_that_call():
    pool, engine, _ = make(batch=2)
    engine.fail_start = ValueError("bad voice file")
    a, b = pool.admit("NATF0", "p"), pool.admit("NATF0", "p")
    pool.ticker.tick_once()
    assert (a.state, a.end_reason) == ("ended", "error: ValueError: bad voice file")
    assert b.state == "live" and engine.ended == [0]
    c = pool.admit("NATF0", "p")
    assert c.slot == 0  # the failed call's slot is free again
    pool.ticker.tick_once()
    assert c.state == "live" and sorted(engine.active) == [0, 1]


def test_release_during_prefill_frees_the_slot_and_ends_the_session():
    engine = FakeEngine(batch_size=1)
    engine.prefill_gate = threading.Event()
    pool = SlotPool(engine, PoolConfig())
    pool.start()
    try:
        a = pool.admit("NATF0", "p")
        assert engine.prefill_entered.wait(2)
        a.release()
        a.release()  # double release: harmless
        engine.prefill_gate.set()
        deadline = time.monotonic() + 2
        while pool.snapshot().slots_free < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (a.state, a.end_reason) == ("ended", "hangup")
        assert engine.ended == [0] and engine.active == set()
        b = pool.admit("NATF0", "p")
        asyncio.run(b.wait_live(2))
        assert b.slot == 0
    finally:
        pool.shutdown()
    assert len(engine.threads) == 1  # only the ticker thread touched the engine


def test_release_before_prefill_started_needs_no_engine_call():
    pool, engine, _ = make(batch=1)
    a = pool.admit("NATF0", "p")
    a.release()
    pool.ticker.tick_once()
    assert engine.started == [] and engine.ended == []
    assert pool.admit("NATF0", "p").slot == 0


def test_double_release_frees_once():
    pool, engine, _ = make(batch=2)
    a = live_call(pool)
    a.release()
    a.release("cancelled")
    assert a.end_reason == "hangup"
    pool.ticker.tick_once()
    pool.ticker.tick_once()
    assert engine.ended == [0]
    assert [pool.admit("NATF0", "p").slot for _ in range(2)] == [0, 1]


def test_shutdown_ends_everything_and_refuses_new_calls():
    pool, engine, _ = make(batch=1)
    a = live_call(pool)
    a.push_audio(frame(1))
    pool.ticker.tick_once()
    q = pool.admit("NATF0", "p")
    pool.shutdown()
    pool.shutdown()  # idempotent
    assert (a.end_reason, q.end_reason, q.queue_position) == ("shutdown", "shutdown", None)
    assert engine.ended == [0] and engine.active == set()
    with pytest.raises(PoolClosedError):
        pool.admit("NATF0", "p")
    with pytest.raises(PoolClosedError):
        pool.start()
    assert len(drain(a)) == 1  # what was produced can still be read, then CallEnded
    with pytest.raises(CallEnded) as info:
        asyncio.run(a.next_output(0.1))
    assert info.value.reason == "shutdown"
    m = pool.snapshot()
    assert (m.slots_free, m.slots_live, m.slots_prefill, m.queue_length) == (1, 0, 0, 0)


# ---- asyncio side -------------------------------------------------------------------------------


def test_awaiting_never_blocks_the_loop_and_wakes_across_threads():
    pool, _, _ = make(batch=1)
    a = live_call(pool)
    queued = pool.admit("NATF0", "p")

    async def scenario() -> None:
        beats = 0

        async def heartbeat() -> None:
            nonlocal beats
            while True:
                await asyncio.sleep(0.005)
                beats += 1

        hb = asyncio.create_task(heartbeat())
        assert await a.next_output(0.2) is None  # timeout: None, and the loop kept running
        assert beats >= 10
        with pytest.raises(TimeoutError):
            await queued.wait_live(timeout=0.05)

        def ticker_side() -> None:  # another thread produces the output the loop is awaiting
            time.sleep(0.05)
            a.push_audio(frame(4))
            pool.ticker.tick_once()

        threading.Thread(target=ticker_side).start()
        started = time.monotonic()
        out = await a.next_output(2.0)
        assert out is not None and out.pcm[1] == 4 and time.monotonic() - started < 1.0

        waiter = asyncio.create_task(queued.wait_live())
        await asyncio.sleep(0.02)
        threading.Thread(target=queued.release).start()
        with pytest.raises(CallEnded) as info:
            await asyncio.wait_for(waiter, 1.0)
        assert info.value.reason == "hangup"
        hb.cancel()

    asyncio.run(scenario())
    assert a._waiters == [] and queued._waiters == []  # no awaiter left registered


def test_outputs_drain_before_call_ended():
    pool, _, _ = make(batch=1)
    a = live_call(pool)
    for _ in range(3):
        pool.ticker.tick_once()
    a.release()

    async def read_all() -> tuple[int, str]:
        n = 0
        while True:
            try:
                await a.next_output(1.0)
                n += 1
            except CallEnded as exc:
                return n, exc.reason

    assert asyncio.run(read_all()) == (3, "hangup")
    with pytest.raises(CallEnded):
        asyncio.run(a.wait_live())


# ---- real clock, ticker thread ------------------------------------------------------------------


def test_real_clock_several_callers_no_leak_and_audio_every_live_tick():
    engine = FakeEngine(batch_size=4, step_seconds=0.003)
    pool = SlotPool(engine, PoolConfig(max_queue=8))
    pool.start()
    received: dict[str, list[SlotOutput]] = {}

    async def caller(talk_seconds: float) -> Call:
        call = pool.admit("NATF0", "p")
        await call.wait_live(timeout=5)
        outs = received.setdefault(call.id, [])

        async def consume() -> None:
            try:
                while True:
                    out = await call.next_output(1.0)
                    if out is not None:
                        outs.append(out)
            except CallEnded:
                pass

        reader = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        start = loop.time()
        k = 0
        while loop.time() - start < talk_seconds:
            call.push_audio(frame(k))
            k += 1
            await asyncio.sleep(max(0.0, start + k * 0.08 - loop.time()))
        call.release()
        await asyncio.wait_for(reader, 2)
        return call

    async def everyone() -> list[Call]:
        return list(await asyncio.gather(*(caller(1.0 + 0.2 * i) for i in range(6))))

    try:
        calls = asyncio.run(everyone())
        deadline = time.monotonic() + 2
        while pool.snapshot().slots_free < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        m = pool.snapshot()
    finally:
        pool.shutdown()

    assert (m.slots_free, m.slots_live, m.slots_prefill, m.queue_length) == (4, 0, 0, 0)
    assert engine.active == set() and len(engine.ended) == 6 and len(engine.threads) == 1
    for call in calls:
        outs = received[call.id]
        ticks = [o.tick for o in outs]
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))  # one output for every live tick
        assert len(outs) == call.counters.frames_out >= 5
        assert all(o.pcm[0] == call.slot for o in outs)
        assert call.counters.output_drops == 0
    assert m.ticks > 20 and m.latency_p50_ms > 0
