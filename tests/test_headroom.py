"""Admission by measured headroom (serving/headroom.py): the policy with injected tick costs and
times, the slot pool under it with a fake clock and an engine whose tick cost grows with its rows,
and placement across engines. Nothing here depends on how fast this machine is."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette

from personaplex_demo.call_settings import SamplingParams
from personaplex_demo.engine.pcm import TickOutput
from personaplex_demo.engine.rows import batch_bucket
from personaplex_demo.procs.pool_router import PoolRouter
from personaplex_demo.serving.call import Call
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.headroom import HeadroomPolicy, WaitReason
from personaplex_demo.serving.loop_lag import ensure_probe, probe
from personaplex_demo.serving.metrics import PoolMetrics
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import CallEnded, CallState, PoolClosedError, PoolFullError
from personaplex_demo.web.page import status_payload
from personaplex_demo.web.prometheus import metrics_routes
from personaplex_demo.web.status import SharedFigures, limited_by, status_line

from .support.fake_clock import FakeClock
from .support.waiting import eventually
from .test_metrics import scrape
from .test_pool import FakeEngine, frame, run_for

MS = 1e-3
TICK = 0.08


def measured(policy: HeadroomPolicy, rows: int, seconds: float, at: float, ticks: int = 16) -> float:
    """`ticks` ticks of `rows` rows, one every 80 ms from `at`; the time after the last."""
    for i in range(ticks):
        policy.record_tick(at + i * TICK, rows, seconds)
    return at + ticks * TICK


def joined(policy: HeadroomPolicy, calls: int, seconds: float = 40 * MS) -> float:
    """Calls that joined one by one: each batch below `calls` measured within budget from 0 s."""
    now = 0.0
    for rows in range(1, calls):
        now = measured(policy, rows, seconds, now)
    return now


# ---- the policy, costs injected ------------------------------------------------------------------


def test_a_caller_alone_is_always_admitted_and_before_any_tick_the_memory_arithmetic_decides():
    policy = HeadroomPolicy(PoolConfig(headroom_prior_rows=4))
    assert policy.admits(0.0, 0)
    assert [policy.admits(0.0, rows) for rows in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    # A tick time alone is not trusted yet (fewer than min_samples ticks): still the arithmetic.
    policy.record_tick(0.0, 1, 200 * MS)
    assert policy.admits(0.1, 2) and not policy.admits(0.1, 4)
    # Once it is, the measurement decides, whatever the arithmetic said.
    now = measured(policy, 1, 200 * MS, 0.0)
    assert not policy.admits(now, 1) and policy.admits(now, 0)


def test_one_more_row_is_admitted_while_its_predicted_tick_fits_with_the_margin():
    policy = HeadroomPolicy(PoolConfig())  # 80 ms budget, 15 % margin: 68 ms
    now = measured(policy, 2, 30 * MS, 0.0)
    # One size known: its cost is shared out per row (30 ms / 2 rows), so 3 rows -> 45 ms.
    assert policy.predict(now, 3) == pytest.approx(45 * MS)
    assert policy.admits(now, 2)
    now = measured(policy, 3, 50 * MS, now)
    # Two sizes: the fitted slope (20 ms a row) from the largest: 4 rows -> 70 ms > 68 ms.
    assert policy.predict(now, 4) == pytest.approx(70 * MS)
    assert not policy.admits(now, 3)
    assert policy.admits(now, 2)  # 3 rows measured at 50 ms
    assert policy.headroom(now, 3) == pytest.approx(10 * MS)


def test_a_busy_host_stops_admission_and_admission_resumes_when_the_tick_recovers():
    policy = HeadroomPolicy(PoolConfig())
    now = measured(policy, 2, 25 * MS, 0.0)
    assert policy.admits(now, 2)
    now = measured(policy, 2, 85 * MS, now, ticks=32)  # the host got busy: same rows, slower ticks
    assert not policy.admits(now, 2) and not policy.admits(now, 1)
    assert policy.headroom(now, 2) < 0
    now = measured(policy, 2, 25 * MS, now, ticks=32)  # and calmed down
    assert policy.admits(now, 2)


def test_a_size_measured_within_budget_is_taken_again_though_a_prediction_would_need_the_margin():
    policy = HeadroomPolicy(PoolConfig())
    now = measured(policy, 4, 74 * MS, 0.0)  # 4 rows ran within the 80 ms budget, above 68 ms
    now = measured(policy, 3, 55 * MS, now, ticks=8)  # one of them hung up
    assert policy.admits(now, 3)  # its place is taken again
    assert not policy.admits(now, 4)  # 5 rows are predicted at 93 ms
    worse = measured(policy, 4, 84 * MS, now)
    assert not policy.admits(worse, 3)  # once 4 rows ran over budget, not any more


def test_a_size_not_ticked_at_for_a_while_is_forgotten():
    policy = HeadroomPolicy(PoolConfig())  # a size is forgotten after 30 s
    now = measured(policy, 3, 90 * MS, 0.0)  # measured while the host was busy
    now = measured(policy, 2, 30 * MS, now)
    assert not policy.admits(now, 2)  # 3 rows measured recently at 90 ms
    later = measured(policy, 2, 30 * MS, now + 40.0)
    assert policy.predict(later, 3) == pytest.approx(45 * MS)  # from 2 rows only
    assert policy.admits(later, 2)


def test_a_lagging_event_loop_holds_admission_until_its_reports_recover_or_age():
    policy = HeadroomPolicy(PoolConfig(media_lag_limit_seconds=0.05))  # a report counts for 3 s
    now = measured(policy, 1, 10 * MS, 0.0)
    policy.record_media_lag(now, "worker-1", 0.02)
    assert policy.admits(now, 1)
    policy.record_media_lag(now, "worker-2", 0.2)
    assert not policy.admits(now, 1) and policy.media_lag(now) == 0.2
    assert policy.admits(now, 0)  # nobody to protect
    policy.record_media_lag(now + 1, "worker-2", 0.01)
    assert policy.admits(now + 1, 1)
    policy.record_media_lag(now + 2, "worker-2", 0.3)
    assert policy.admits(now + 2 + 3.5, 1)  # a report older than media_lag_memory_seconds no longer counts


def test_shedding_waits_for_a_sustained_overload_then_restarts_its_clock():
    policy = HeadroomPolicy(PoolConfig(shed_after_seconds=3.0))
    now = measured(policy, 4, 120 * MS, joined(policy, 4), ticks=25)  # the mean is over budget for 0.7 s
    assert not policy.shed_due(now, 4)
    now = measured(policy, 4, 120 * MS, now, ticks=30)  # 3.1 s
    assert policy.shed_due(now, 4)
    assert not policy.shed_due(now, 3)  # the clock restarted: the smaller batch gets its own 3 s
    now = measured(policy, 3, 100 * MS, now, ticks=40)
    assert policy.shed_due(now, 3)
    now = measured(policy, 2, 100 * MS, now, ticks=100)
    assert not policy.shed_due(now, 1)  # a caller alone is never shed
    now = measured(policy, 2, 60 * MS, now, ticks=40)  # within budget: no overload
    assert not policy.shed_due(now, 2)


def test_no_more_calls_are_shed_while_the_last_shed_left_the_ticks_as_long():
    policy = HeadroomPolicy(PoolConfig(shed_after_seconds=3.0))
    now = measured(policy, 4, 100 * MS, joined(policy, 4), ticks=60)
    assert policy.shed_due(now, 4)
    now = measured(policy, 3, 98 * MS, now, ticks=60)  # the host, not the rows: no shorter
    assert not policy.shed_due(now, 3)
    now = measured(policy, 3, 60 * MS, now, ticks=40)  # recovered: the overload is over
    now = measured(policy, 3, 110 * MS, now, ticks=60)  # and a new one starts
    assert policy.shed_due(now, 3)


def test_one_short_tick_right_after_a_shed_does_not_end_the_overload():
    policy = HeadroomPolicy(PoolConfig(shed_after_seconds=3.0))
    now = measured(policy, 4, 100 * MS, joined(policy, 4), ticks=60)
    assert policy.shed_due(now, 4)
    now = measured(policy, 3, 40 * MS, now, ticks=1)  # the first tick of the smaller batch, alone, is short
    now = measured(policy, 3, 98 * MS, now, ticks=60)  # then the ticks are as long as before the shed
    assert not policy.shed_due(now, 3)  # the host's doing: no second shed


def test_a_call_is_shed_only_when_the_room_one_call_smaller_was_measured_within_budget():
    """The newest call is what pushed the tick over when the room ticked within budget without
    it; a tick that is slow with one call fewer too is the host's doing: nobody is shed."""
    policy = HeadroomPolicy(PoolConfig(shed_after_seconds=3.0))
    now = measured(policy, 4, 100 * MS, joined(policy, 4), ticks=60)  # 3 calls ticked at 40 ms
    assert policy.shed_due(now, 4)
    host = HeadroomPolicy(PoolConfig(shed_after_seconds=3.0))
    now = measured(host, 1, 95 * MS, 0.0)  # the host is slow: one call alone is over budget too
    now = measured(host, 2, 100 * MS, now, ticks=60)
    assert not host.shed_due(now, 2)
    assert not host.admits(now, 2)  # the overload holds admission instead


def test_one_more_call_costs_the_rows_it_adds_and_the_room_grows_one_measured_call_at_a_time():
    """Calls step batch buckets of 1, 2, 4, 8 rows: a third call opens the bucket of 4 (two more
    rows), a fourth adds none, a fifth opens the bucket of 8 (four more)."""
    policy = HeadroomPolicy(PoolConfig(), bucket=lambda n: batch_bucket(n, [1, 2, 4, 8]))
    now = measured(policy, 1, 20 * MS, 0.0)
    now = measured(policy, 2, 30 * MS, now)  # 10 ms a row
    assert policy.predict(now, 3) == pytest.approx(50 * MS)  # 2 more rows
    assert policy.admits(now, 2)
    assert policy.predict(now, 4) is None and not policy.admits(now, 3)  # 3 calls not measured yet
    now = measured(policy, 3, 52 * MS, now)
    assert policy.predict(now, 4) == pytest.approx(52 * MS)  # the same 4 rows: only the call's own share
    now = measured(policy, 4, 60 * MS, now)
    assert policy.predict(now, 5) > 90 * MS and not policy.admits(now, 4)  # 4 more rows at ~10 ms


def test_a_short_spike_is_not_an_overload_and_shedding_can_be_turned_off():
    policy = HeadroomPolicy(PoolConfig())
    now = measured(policy, 4, 40 * MS, 0.0, ticks=40)
    now = measured(policy, 4, 300 * MS, now, ticks=2)  # a GC pause, a prefill
    now = measured(policy, 4, 40 * MS, now, ticks=40)
    assert not policy.shed_due(now + 10, 4)
    off = HeadroomPolicy(PoolConfig(shed_when_overloaded=False))
    now = measured(off, 4, 150 * MS, 0.0, ticks=200)
    assert not off.shed_due(now, 4)


# ---- the slot pool under the policy (fake clock, a tick cost that grows with the rows) -----------


class CostlyEngine(FakeEngine):
    """A fake engine whose step takes `fixed + per_row * rows` seconds of the fake clock, times `load`."""

    def __init__(self, batch: int, clock: FakeClock, fixed: float, per_row: float) -> None:
        super().__init__(batch, clock)
        self.fixed, self.per_row, self.load = fixed, per_row, 1.0

    def step(self, pcm: np.ndarray) -> TickOutput:
        self.step_seconds = self.load * (self.fixed + self.per_row * len(self.active))
        return super().step(pcm)


def costly_pool(batch: int = 6, **config) -> tuple[SlotPool, CostlyEngine]:
    clock = FakeClock()
    engine = CostlyEngine(batch, clock, fixed=5 * MS, per_row=20 * MS)  # 1 row 25 ms, 3 rows 65, 4 rows 85
    return SlotPool(engine, PoolConfig(**{"idle_release_seconds": 60.0, **config}), clock), engine


def talk(pool: SlotPool, calls, turns: int) -> None:
    """`turns` ticks with a frame from every live caller before each."""
    for _ in range(turns):
        for call in calls:
            if call.state == "live":
                call.push_audio(frame(0.1))
        run_for(pool, 1)


def join(pool: SlotPool, calls: list, turns: int = 16):
    call = pool.admit("NATF0", "p")
    calls.append(call)
    talk(pool, calls, turns)
    return call


def test_callers_beyond_the_measured_headroom_wait_with_the_reason_and_get_in_when_a_call_ends():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=1)
    calls: list = []
    first, second, third = (join(pool, calls) for _ in range(3))
    assert [c.state for c in calls] == ["live"] * 3  # 25, 45, 65 ms: each predicted, each fits in 68
    fourth = join(pool, calls)  # 4 rows are predicted at 85 ms
    assert (fourth.state, fourth.queue_position, fourth.wait_reason) == ("queued", 1, WaitReason.CAPACITY)
    m = pool.snapshot()
    assert (m.slots_free, m.queue_length, m.calls_held_back, m.admitting) == (3, 1, 1, 0)
    assert m.headroom_ms == pytest.approx(80 - 85)
    fifth = join(pool, calls, turns=40)  # it waits behind the fourth, whatever the free slots
    assert (fifth.state, fifth.queue_position) == ("queued", 2)
    assert pool.snapshot().calls_held_back == 2

    first.release()
    talk(pool, calls, 3)
    assert fourth.state == "live" and (fifth.state, fifth.queue_position) == ("queued", 1)
    assert [c.state for c in (second, third)] == ["live", "live"]
    assert pool.snapshot().calls_ended.get("overloaded", 0) == 0


def test_the_page_and_the_status_say_why_a_caller_waits():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=1)
    calls: list = []
    for _ in range(4):
        join(pool, calls)
    runtime = types.SimpleNamespace(model_name="tiny", is_tiny=True, banner=None, weights="dense", device_name="cpu",
                                    capacity_facts=lambda: None)
    payload = status_payload(runtime, pool)
    assert (payload["admission"], payload["queue_reason"], payload["queue_length"]) == ("headroom", WaitReason.CAPACITY, 1)
    assert payload["calls_held_back"] == 1 and payload["admitting"] == 0
    assert payload["limited_by"] == "tick"
    line = status_line(calls[3], SharedFigures(pool))
    assert line.startswith("The room is at capacity on this machine: you are number 1 in the queue"), line
    assert status_line(calls[0], SharedFigures(pool)).startswith("Live")


def test_a_live_callers_status_line_counts_its_own_slot_before_the_shared_figures_do():
    pool, _ = costly_pool(batch=1)
    figures = SharedFigures(pool)
    figures.get()  # the page's shared figures, taken before the call (kept half a second)
    call = join(pool, [])
    assert call.state == "live"
    line = status_line(call, figures)
    assert line.startswith("Live") and line.endswith("slots 1/1 in use"), line


def test_with_admission_by_slots_every_free_slot_is_taken():
    pool, _ = costly_pool(batch=6, admission="slots", headroom_prior_rows=1)
    calls: list = []
    for _ in range(5):
        join(pool, calls)
    assert [c.state for c in calls] == ["live"] * 5
    assert pool.snapshot().calls_held_back == 0


def test_a_slot_freed_a_moment_ago_is_not_a_lack_of_capacity():
    for admission in ("slots", "headroom"):
        pool, _ = costly_pool(batch=1, admission=admission)
        calls: list = []
        first = join(pool, calls)
        join(pool, calls)  # waits for the one slot
        with pool._lock:
            pool._table.vacate(first.slot)  # between a slot's release and the ticker seating the head
            newcomer = Call(pool._ctx, "NATF0", "p", SamplingParams())
            pool._table.place(newcomer, True)
        assert (newcomer.state, newcomer.queue_position, newcomer.wait_reason) == ("queued", 2, WaitReason.SLOTS)
        assert pool.snapshot().calls_held_back == 0, admission


def test_a_full_queue_with_slots_free_says_the_room_is_at_capacity():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=1, max_queue=1)
    calls: list = []
    for _ in range(4):
        join(pool, calls)  # three live, the fourth waits for headroom
    with pytest.raises(PoolFullError, match=f"^{WaitReason.CAPACITY} and the queue of 1 is full"):
        pool.admit("NATF0", "p")


def test_a_full_room_says_its_slots_are_busy():
    pool, _ = costly_pool(batch=1)
    calls: list = []
    join(pool, calls)
    waiting = join(pool, calls)
    assert (waiting.state, waiting.wait_reason) == ("queued", WaitReason.SLOTS)
    assert pool.snapshot().calls_held_back == 0


def test_when_the_tick_stays_over_budget_the_newest_call_is_shed_first():
    pool, engine = costly_pool(batch=6, headroom_prior_rows=1)
    calls: list = []
    for _ in range(3):
        join(pool, calls)
    assert [c.state for c in calls] == ["live"] * 3
    engine.load = 2.0  # the host gets busy: 3 rows now take 130 ms, 2 rows 90, 1 row 50
    talk(pool, calls, 20)  # 2.6 s of 130 ms ticks: less than 3 s over budget on average
    assert [c.state for c in calls] == ["live"] * 3
    talk(pool, calls, 20)
    assert [c.state for c in calls] == ["live", "live", "ended"]
    assert calls[2].end_reason == "overloaded"
    talk(pool, calls, 40)  # still over budget with two: the next newest goes too
    assert [c.state for c in calls] == ["live", "ended", "ended"]
    talk(pool, calls, 100)  # the first caller is never shed: 50 ms alone fits
    assert calls[0].state == "live" and pool.snapshot().calls_ended["overloaded"] == 2
    latecomer = join(pool, calls)  # and nobody new joins while two would not fit
    assert (latecomer.state, latecomer.wait_reason) == ("queued", WaitReason.CAPACITY)


def test_with_shedding_off_every_call_stays_however_late_the_tick():
    pool, engine = costly_pool(batch=6, headroom_prior_rows=1, shed_when_overloaded=False)
    calls: list = []
    for _ in range(3):
        join(pool, calls)
    engine.load = 2.0
    talk(pool, calls, 100)
    assert [c.state for c in calls] == ["live"] * 3


def test_before_any_tick_the_pool_seats_the_trusted_number_of_callers_at_once():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=2)
    calls = [pool.admit("NATF0", "p") for _ in range(4)]
    assert [c.state for c in calls] == ["prefill", "prefill", "queued", "queued"]
    assert [c.wait_reason for c in calls[2:]] == [WaitReason.CAPACITY, WaitReason.CAPACITY]
    talk(pool, calls, 60)  # measured, then one at a time as each predicted tick fits
    assert [c.state for c in calls] == ["live"] * 3 + ["queued"]


def test_the_media_side_lagging_holds_new_callers():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=1)
    calls: list = []
    join(pool, calls)
    pool.report_media_lag(0.3, "page")
    waiting = join(pool, calls)
    assert (waiting.state, waiting.wait_reason) == ("queued", WaitReason.CAPACITY)
    assert pool.snapshot().media_lag_ms == pytest.approx(300)
    assert limited_by(pool.snapshot(), pool.config.media_lag_limit_seconds) == "media"  # /api/status says why
    full = dataclasses.replace(pool.snapshot(), slots_free=0)
    assert [limited_by(full, 0.05, bound) for bound in ("memory", "--slots", None)] == ["memory", "slots", "slots"]
    pool.report_media_lag(0.01, "page")
    talk(pool, calls, 3)
    assert waiting.state == "live"
    assert limited_by(pool.snapshot(), pool.config.media_lag_limit_seconds) != "media"


def test_metrics_show_the_headroom_gauge_and_the_calls_held_back():
    pool, _ = costly_pool(batch=6, headroom_prior_rows=1)
    calls: list = []
    for _ in range(4):
        join(pool, calls)
    app = Starlette(routes=metrics_routes(pool))

    async def get() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await scrape(http)

    held = asyncio.run(get())
    assert held[("personaplex_calls_held_back_total", ())] == 1
    assert held[("personaplex_admitting", ())] == 0
    assert held[("personaplex_tick_headroom_seconds", ())] == pytest.approx(-0.005)  # 4 rows: 85 ms
    assert held[("personaplex_queue_length", ())] == 1
    calls[0].release()
    talk(pool, calls, 3)
    freed = asyncio.run(get())
    assert freed[("personaplex_admitting", ())] == 0 and freed[("personaplex_queue_length", ())] == 0
    assert freed[("personaplex_calls_held_back_total", ())] == 1  # a counter: it stays
    calls[1].release()
    talk(pool, calls, 3)
    assert asyncio.run(get())[("personaplex_admitting", ())] == 1  # 2 rows held, 3 measured at 65 ms


class Reports:
    def __init__(self) -> None:
        self.lags: list[float] = []

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        self.lags.append(seconds)


def test_the_event_loop_probe_reports_how_late_its_loop_wakes_and_runs_once_per_loop():
    room = Reports()

    async def go() -> None:
        task = asyncio.create_task(probe(room, interval=0.01, period=0.1))
        await asyncio.sleep(0.15)
        quiet = list(room.lags)
        time.sleep(0.25)  # a handler that blocks the loop
        await asyncio.sleep(0.3)
        task.cancel()
        assert quiet and max(room.lags) >= 0.2 > max(quiet)
        other = Reports()
        ensure_probe(other)
        ensure_probe(other)  # the loop's probe runs already
        assert sum(t.get_name() == "event-loop-lag-probe" for t in asyncio.all_tasks()) == 1

    asyncio.run(go())


# ---- placement across engines ---------------------------------------------------------------------


class StubEngine:
    """What PoolRouter reads of an EngineLink: its figures, and an acquire that seats or refuses."""

    def __init__(self, name: str, *, admitting: int, headroom_ms: float, queue: int = 0, slots_free: int = 2,
                 refuses: bool = False) -> None:
        self.name, self.alive, self.slots_total = name, True, 4
        self.config = PoolConfig()
        self.figures = PoolMetrics(slots_total=4, queue_length=queue, admitting=admitting, headroom_ms=headroom_ms,
                                   slots_free=slots_free)
        self.refuses = refuses
        self.seats: int | None = None  # refuses once this many calls were seated
        self.asked: list[bool] = []

    def snapshot(self) -> PoolMetrics:
        return self.figures

    async def acquire(self, voice, persona, sampling=None, door="page", *, queue=True):
        self.asked.append(queue)
        if not queue and (self.refuses or not self.figures.admitting or self.seats == 0):
            raise PoolFullError(WaitReason.CAPACITY)
        self.seats = None if self.seats is None else self.seats - 1
        return types.SimpleNamespace(name=self.name, state=CallState.PREFILL, slot=0, end_reason=None)


def place(*engines: StubEngine) -> str:
    return asyncio.run(PoolRouter(list(engines)).acquire("NATF0", "p")).name


def test_placement_takes_the_engine_with_the_most_headroom_that_admits():
    busy = StubEngine("busy", admitting=0, headroom_ms=-10, slots_free=3)
    some = StubEngine("some", admitting=1, headroom_ms=15)
    most = StubEngine("most", admitting=1, headroom_ms=40, slots_free=1)
    assert place(busy, some, most) == "most"
    most.refuses = True  # it filled up meanwhile: the engine's own answer wins over its last figures
    assert place(busy, some, most) == "some"


async def test_with_no_engine_admitting_callers_wait_in_the_routers_one_queue_for_a_seat_anywhere():
    a = StubEngine("a", admitting=0, headroom_ms=30, slots_free=0)
    b = StubEngine("b", admitting=0, headroom_ms=-5, slots_free=0)
    router = PoolRouter([a, b])
    first = await router.acquire("NATF0", "p")
    second = await router.acquire("NATF1", "p")
    assert (first.state, first.queue_position, first.wait_reason) == ("queued", 1, WaitReason.SLOTS)
    assert (second.state, second.queue_position) == ("queued", 2)
    # Each engine was asked for a seat once, for the first caller; nobody queues at one engine.
    assert (a.asked, b.asked) == ([False], [False])
    assert router.snapshot().queue_length == 2
    # A slot frees on b, but its tick has no headroom: the queue says why it still waits.
    b.figures = dataclasses.replace(b.figures, slots_free=1)
    await eventually(lambda: (first.wait_reason, second.wait_reason) == (WaitReason.CAPACITY,) * 2, "the reason")
    assert router.snapshot().calls_held_back == 2  # each caller held back counts once
    # It admits: the head takes the seat there, and the second moves up.
    b.figures, b.seats = dataclasses.replace(b.figures, admitting=1), 1
    await eventually(lambda: first.inner is not None, "the head seated")
    assert first.inner.name == "b" and first.queue_position is None
    assert (second.state, second.queue_position) == ("queued", 1)
    # The second hangs up while waiting: it leaves the queue, counted as a hang-up.
    second.release()
    await eventually(lambda: router.snapshot().calls_ended == {"hangup": 1}, "the hang-up counted")
    assert router.snapshot().queue_length == 0
    with pytest.raises(CallEnded):
        await second.wait_live(1)


def test_a_router_with_every_engine_gone_refuses():
    gone = StubEngine("gone", admitting=1, headroom_ms=50)
    gone.alive = False
    with pytest.raises(PoolClosedError):
        place(gone)
