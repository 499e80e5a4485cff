"""TickGather: a client's callers' audio held until just before the engine's next planned tick, on a
hand-driven clock and loop (every time it checks is exact); a real link's batches are in
test_engine_link.py."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_demo.procs.tick_gather import LEAD, TickGather

TICK = 0.08


class HandLoop:
    """`call_later` on a clock the test moves: `advance` runs what falls due."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[Timer] = []

    def call_later(self, delay: float, callback) -> Timer:
        timer = Timer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while due := sorted((t for t in self.timers if not t.cancelled and t.when <= end), key=lambda t: t.when):
            timer = due[0]
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = end


class Timer:
    def __init__(self, when: float, callback) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def gathered():
    loop, sent = HandLoop(), []
    gather = TickGather(lambda batch: sent.append((loop.now, batch)), TICK, clock=lambda: loop.now)
    gather.loop = loop
    return gather, loop, sent


def packet(value: int) -> np.ndarray:
    return np.full(960, value, np.int16)


def test_without_a_plan_each_packet_goes_as_it_comes(gathered):
    gather, loop, sent = gathered
    gather.push(1, packet(1), loop.now)
    gather.plan(None, loop.now, 1)  # an engine that says nothing of its schedule
    loop.advance(0.04)
    gather.push(1, packet(2), loop.now)
    assert [(len(batch), batch[0].samples[0], batch[0].held) for _, batch in sent] == [(1, 1, 0.0), (1, 2, 0.0)]


def test_packets_of_every_call_leave_together_just_before_the_planned_tick_each_with_its_time_held(gathered):
    gather, loop, sent = gathered
    start = loop.now
    gather.plan(0.075, start, 1)  # the engine's next tick: 75 ms from now
    gather.push(1, packet(1), loop.now)
    loop.advance(0.02)
    gather.push(2, packet(2), loop.now)
    loop.advance(0.02)
    gather.push(1, packet(3), loop.now)
    assert not sent
    loop.advance(0.1)
    (left, batch), = sent
    assert left == pytest.approx(start + 0.075 - LEAD) and gather.batches == 1
    assert [(p.rid, p.samples[0]) for p in batch] == [(1, 1), (2, 2), (1, 3)]  # in order of arrival
    assert [p.held for p in batch] == pytest.approx([0.075 - LEAD, 0.055 - LEAD, 0.035 - LEAD])


def test_a_packet_too_close_to_the_tick_goes_at_once_behind_what_was_held(gathered):
    gather, loop, sent = gathered
    gather.plan(0.05, loop.now, 1)
    gather.push(1, packet(1), loop.now)
    loop.now += 0.05 - LEAD / 2  # the timer is late (a busy loop) and the next packet comes within the lead
    gather.push(1, packet(2), loop.now)
    (_, batch), = sent
    assert [p.samples[0] for p in batch] == [1, 2]
    loop.advance(0.2)
    assert len(sent) == 1  # nothing was left to send when the timer came


def test_after_a_tick_whose_outputs_are_not_here_yet_audio_waits_for_the_tick_after_it(gathered):
    gather, loop, sent = gathered
    start = loop.now
    gather.plan(0.01, start, 1)
    loop.advance(0.02)  # that tick has come; its outputs (and a fresh plan) are on their way
    gather.push(1, packet(1), loop.now)
    loop.advance(0.2)
    (left, _), = sent
    assert left == pytest.approx(start + 0.01 + TICK - LEAD)


def test_a_tick_brought_forward_sends_what_is_held_earlier(gathered):
    gather, loop, sent = gathered
    start = loop.now
    gather.plan(0.07, start, 1)
    gather.push(1, packet(1), loop.now)
    loop.advance(0.005)
    gather.plan(0.04, loop.now, 2)  # the engine moved its tick 25 ms forward
    loop.advance(0.2)
    (left, _), = sent
    assert left == pytest.approx(start + 0.045 - LEAD)


def test_a_plan_gone_stale_holds_nothing_and_an_ended_call_s_audio_is_dropped(gathered):
    gather, loop, sent = gathered
    gather.plan(0.07, loop.now, 1)
    gather.push(1, packet(1), loop.now)
    gather.push(2, packet(2), loop.now)
    gather.forget(1)
    loop.advance(0.1)
    assert [[p.rid for p in batch] for _, batch in sent] == [[2]]
    loop.advance(1.0)  # no word from the engine for a second: its old plan says nothing now
    gather.push(2, packet(3), loop.now)
    assert len(sent) == 2 and sent[-1][1][0].held == 0.0


def test_an_older_tick_s_plan_or_one_already_due_is_not_gone_by(gathered):
    gather, loop, sent = gathered
    start = loop.now
    gather.plan(0.06, start, 5)
    gather.plan(0.02, start, 4)  # a call's output of the tick before, relayed late
    gather.push(1, packet(1), loop.now)
    loop.advance(0.2)
    assert sent[0][0] == pytest.approx(start + 0.06 - LEAD)
    gather.plan(-0.01, loop.now, 6)  # due before it was heard: no plan until the next
    gather.push(1, packet(2), loop.now)
    assert len(sent) == 2 and sent[1][1][0].held == 0.0


def test_a_late_loop_makes_the_lead_longer_and_a_closed_link_sends_nothing_more(gathered):
    gather, loop, sent = gathered
    start = loop.now
    gather.plan(0.06, start, 1)
    gather.push(1, packet(1), loop.now)
    loop.now = start + 0.06 - LEAD + 0.008  # the loop came to the timer 8 ms late
    loop.advance(0)
    assert len(sent) == 1 and gather.lead == pytest.approx(LEAD + 0.008)
    heard = loop.now
    gather.plan(0.07, heard, 2)
    gather.push(1, packet(2), loop.now)
    gather.close()
    loop.advance(0.2)
    assert len(sent) == 1  # the held packet went with the link
