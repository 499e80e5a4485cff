"""A live call's input between the door and the tick (serving/inbox.py), driven through a SlotPool
on a fake clock by a caller whose 40 ms packets arrive when the test says: exact samples on a clean
link, a margin that follows the jitter, and a delay that never grows (a fast clock, a burst, a late
packet) and comes back within seconds."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import numpy as np
import pytest

from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.inbox import Inbox, InboxConfig
from personaplex_demo.serving.pool import SlotPool

from .support.fake_clock import FakeClock
from .test_pool import FRAME, FakeEngine, drain

PACKET = FRAME // 2  # 40 ms


class ScheduledClock(FakeClock):
    """A fake clock that runs scheduled events at their times while the ticker sleeps through them."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, when: float, event: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), event))

    def sleep(self, seconds: float) -> None:
        until = self.monotonic() + max(0.0, seconds)
        while self._events and self._events[0][0] <= until:
            when, _, event = heapq.heappop(self._events)
            super().advance(max(0.0, when - self.monotonic()))
            event()
        super().advance(max(0.0, until - self.monotonic()))


def caller_room(arrivals: list[float], samples: np.ndarray | None = None, seconds: float | None = None):
    """One live call; packet k (960 samples of `samples`, a ramp 1, 2, ... by default) reaches the
    room at `arrivals[k]`. Runs the ticker until `seconds` (the last arrival by default); returns
    (the call's outputs, the engine's inputs for its row, the pool)."""
    clock = ScheduledClock()
    engine = FakeEngine(1, clock)
    pool = SlotPool(engine, PoolConfig(), clock)
    call = pool.admit("NATF0", "p")
    pool.ticker.tick_once()  # prefilled: live
    if samples is None:
        samples = np.arange(1, len(arrivals) * PACKET + 1, dtype=np.float32)
    for k, when in enumerate(arrivals):
        clock.at(when, lambda k=k: call.push_audio(samples[k * PACKET:(k + 1) * PACKET]))
    end = seconds if seconds is not None else max(arrivals)
    outputs = []
    while clock.monotonic() < end:
        pool.ticker.iterate()
        outputs += drain(call)
    return outputs, np.concatenate([x[0] for x in engine.inputs]), pool


def delays(outputs) -> tuple[np.ndarray, np.ndarray]:
    """(when each answered input frame's newest sample arrived, how long it waited), in seconds."""
    waited = np.array([o.latency for o in outputs if o.latency is not None])
    ticks = np.array([o.tick for o in outputs if o.latency is not None]) * 0.08
    return ticks, waited


def test_a_clean_link_gives_the_engine_exactly_the_samples_sent_and_each_frame_right_after_its_packet():
    for phase in (0.003, 0.013, 0.041, 0.077):  # wherever the caller's packets fall between two ticks
        arrivals = [phase + 0.04 * k for k in range(250)]  # 10 s
        outputs, heard, pool = caller_room(arrivals, seconds=arrivals[-1] - 0.05)  # the caller still talking
        sent = np.arange(1, 250 * PACKET + 1, dtype=np.float32)
        real = heard[heard != 0]
        assert np.array_equal(real, sent[:real.size]), phase  # none dropped, none repeated, in order
        first = np.flatnonzero(heard)[0]
        assert not heard[first:first + real.size].size - real.size  # silence only before the first packet
        assert sent.size - real.size < 3 * FRAME  # at most what came after the last tick
        _, waited = delays(outputs[5:])
        # A frame is cut at the tick from what has arrived: it waits for the tick (less than one
        # packet's spacing) and not for frame boundaries drawn at the call's start.
        assert waited.max() < 0.04 + 1e-9, phase
        assert pool.snapshot().underruns == 0 and pool.snapshot().input_drops == 0


def test_the_delay_never_grows_with_a_caller_clock_0_1_percent_fast():
    spacing = 0.04 / 1.001  # five minutes of it: 300 ms more audio than the room takes
    arrivals = [0.013 + spacing * k for k in range(int(300 / spacing))]
    outputs, heard, pool = caller_room(arrivals, samples=np.ones(len(arrivals) * PACKET, np.float32))
    ticks, waited = delays(outputs)
    slope = np.polyfit(ticks, waited, 1)[0]
    assert slope * 1e3 <= 0.2, f"{slope * 1e3:.3f} ms per second"  # unbounded, it would be 1 ms per second
    assert waited[-250:].max() < 0.1  # the last 20 s as prompt as the first
    assert pool.snapshot().input_drops <= 8  # what was cut: the 300 ms surplus, in whole frames


def test_after_a_one_second_burst_the_delay_is_back_within_40_ms_in_5_s():
    # The network holds the caller's packets for one second, then delivers them all at once.
    arrivals = [0.013 + 0.04 * k for k in range(750)]  # 30 s
    stall = [k for k, t in enumerate(arrivals) if 10.0 <= t < 11.0]
    for k in stall:
        arrivals[k] = 11.0
    outputs, _, pool = caller_room(arrivals)
    ticks, waited = delays(outputs)
    before = np.median(waited[(ticks > 5) & (ticks < 10)])
    after = waited[ticks > 11.0 + 5.0]
    assert after.max() <= before + 0.04, (before, after.max())
    assert pool.snapshot().resyncs == 0


def test_a_late_packet_costs_one_short_frame_and_a_margin_that_comes_back_down():
    arrivals = [0.078 + 0.04 * k for k in range(500)]  # each frame's last packet 2 ms before its tick
    late = 100  # the last packet of the frame the tick at 4.08 s takes
    arrivals[late] += 0.03  # one packet 30 ms late: after its tick
    outputs, heard, pool = caller_room(arrivals, seconds=arrivals[-1] - 0.05)
    ticks, waited = delays(outputs)
    assert pool.snapshot().underruns == 1
    before = np.median(waited[(ticks > 1) & (ticks < 4)])
    assert np.median(waited[(ticks > 4.2) & (ticks < 6)]) > before  # a margin now covers such a delay
    assert waited[ticks > 4.1 + 5.0].max() <= before + 0.04  # and within 5 s it is gone again


def test_a_standing_excess_is_cut_from_the_quietest_audio():
    inbox = Inbox(InboxConfig())
    loud = np.full(PACKET, 0.5, np.float32)
    now = 0.0
    for k in range(6):  # 240 ms at once: a burst, the last two packets silent
        inbox.push(loud if k < 4 else np.zeros(PACKET, np.float32), now)
    taken = []
    for _ in range(20):  # 1.6 s of ticks with one frame arriving per tick: the excess stands
        now += 0.08
        inbox.push(loud, now)
        inbox.push(loud, now)
        taken.append(inbox.take(now).frame)
    heard = np.concatenate(taken)
    assert inbox.dropped > 0
    assert heard[:4 * PACKET].min() == 0.5  # the loud start is all heard: the silence went first
    assert inbox.size <= FRAME // 2 + InboxConfig().samples(0.02)


def test_a_resync_keeps_at_most_one_frame():
    inbox = Inbox(InboxConfig())
    inbox.push(np.ones(10 * FRAME, np.float32), 0.0)
    assert inbox.trim(FRAME) == 9 * FRAME and inbox.size == FRAME
    assert PoolConfig().resync_keep_frames == 1


@pytest.mark.parametrize("chunk", [7, 480, 960, 1920, 5000])
def test_frames_are_cut_from_chunks_of_any_length(chunk):
    inbox = Inbox(InboxConfig(window_seconds=1e9))  # nothing cut: only the cutting into frames
    sent = np.arange(1, 20 * FRAME + 1, dtype=np.float32)
    for start in range(0, sent.size, chunk):
        inbox.push(sent[start:start + chunk], 0.0)
    frames = [inbox.take(0.0).frame for _ in range(20)]
    assert np.array_equal(np.concatenate(frames), sent)


def test_the_tick_moves_to_just_after_the_callers_packets_without_costing_anybody_a_frame():
    # Packets 3 ms after each tick: each frame would wait 37 ms for the next one.
    arrivals = [0.003 + 0.04 * k for k in range(250)]  # 10 s
    outputs, heard, pool = caller_room(arrivals, seconds=arrivals[-1] - 0.05)
    ticks, waited = delays(outputs)
    assert waited[ticks < 1.5].min() > 0.03
    assert waited[ticks > 3.0].max() < 0.012  # the guard (5 ms) and what the move left over
    assert pool.snapshot().underruns == 0
    # The move came 5 ms a step, and every output's plan said when the next step came: a client that
    # holds audio until just before the planned step (procs/tick_gather.py) is never late for it.
    steps = np.array(pool.ticker.engine.step_times)
    assert np.diff(steps).min() == pytest.approx(0.075) and pool.ticker.pacer.aligner.moved > 0.03
    assert [o.next_take for o in outputs][:steps.size - 1] == pytest.approx(list(steps[1:]))


def test_with_two_callers_the_tick_moves_only_as_far_as_the_later_ones_packets_allow():
    clock = ScheduledClock()
    engine = FakeEngine(2, clock)
    pool = SlotPool(engine, PoolConfig(), clock)
    calls = [pool.admit("NATF0", "p") for _ in range(2)]
    pool.ticker.tick_once()
    for call, phase in zip(calls, (0.003, 0.021), strict=True):  # 37 and 19 ms before the next tick
        for k in range(250):
            clock.at(phase + 0.04 * k, lambda call=call, k=k: call.push_audio(np.full(PACKET, k + 1.0, np.float32)))
    outs: list[list] = [[], []]
    while clock.monotonic() < 9.9:
        pool.ticker.iterate()
        for got, call in zip(outs, calls, strict=True):
            got += drain(call)
    later = [np.array([o.latency for o in got if o.tick * 0.08 > 3.0 and o.latency is not None]) for got in outs]
    assert later[1].max() < 0.012  # the later caller's packets now come just before the tick
    assert 0.015 < later[0].min() and later[0].max() < 0.03  # the other caller gained as much
    assert pool.snapshot().underruns == 0


def test_a_caller_paced_by_the_room_does_not_pull_the_tick_forward_for_ever():
    """A socket door hands over its next frame right after each output (api/feeder.py): its audio
    follows the tick, so its age says nothing of a phase. One move shows it; after that the room
    keeps 12.5 ticks a second."""
    clock = ScheduledClock()
    engine = FakeEngine(1, clock, step_seconds=0.03)
    pool = SlotPool(engine, PoolConfig(), clock)
    call = pool.admit("NATF0", "p")
    pool.ticker.tick_once()
    engine.on_step = lambda _: clock.at(clock.monotonic() + 0.031, lambda: call.push_audio(np.ones(FRAME, np.float32)))
    call.push_audio(np.ones(FRAME, np.float32))
    while clock.monotonic() < 30.0:
        pool.ticker.iterate()
        drain(call)
    assert pool.ticker.pacer.aligner.followers == {call.id}
    assert pool.ticker.pacer.aligner.moved <= 0.04 + 1e-9  # the one move that showed it
    assert abs(engine.steps - 30.0 / 0.08) <= 2  # no faster than real time
