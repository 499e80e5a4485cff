"""The slot pool's counters (per call, and for the room), recent tick times and frame latencies, and
the `PoolMetrics` snapshot that `/api/status`, the page's stats line, `/metrics` and the logs read."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FrameCounters:
    underruns: int = 0  # live ticks with no input frame (after the first): silence stood in
    input_drops: int = 0  # oldest input frames dropped from a full jitter buffer or at a resync
    output_drops: int = 0  # oldest outputs dropped because nobody read them in time


@dataclass
class CallCounters(FrameCounters):
    frames_pushed: int = 0  # pushes of input audio (one per chunk a door handed on)
    frames_out: int = 0


@dataclass
class PoolCounters(FrameCounters):
    """The room's totals; a call's frame counters are added here as they happen."""

    overruns: int = 0  # steps that finished after their deadline
    resyncs: int = 0  # times the ticker fell more than `resync_after_seconds` behind and skipped ahead
    engine_errors: int = 0  # exceptions from engine.step / start_session
    calls_started: int = 0  # calls that went live
    calls_refused: int = 0  # PoolFullError raised
    calls_held_back: int = 0  # calls that waited with a slot free, for lack of headroom in the tick
    calls_ended: collections.Counter[str] = field(default_factory=collections.Counter)  # by `EndReason.kind`
    calls_started_by_door: collections.Counter[str] = field(default_factory=collections.Counter)

    def plain(self) -> dict[str, Any]:
        """Its fields now, the Counters as plain dicts (as `PoolMetrics` has them)."""
        return {**vars(self), "calls_ended": dict(self.calls_ended),
                "calls_started_by_door": dict(self.calls_started_by_door)}


TickListener = Callable[[float, list[float]], None]  # (tick seconds, latencies of the frames it stepped)

logger = logging.getLogger(__name__)

# How many recent ticks / frames the percentiles are computed over.
TICK_WINDOW = 4096
LATENCY_WINDOW = 8192


@dataclass
class PoolMetrics(PoolCounters):
    """The room's figures now: its counters (their two Counters as plain dicts here), and these."""

    slots_total: int = 0
    slots_live: int = 0
    slots_prefill: int = 0
    slots_free: int = 0  # not held by any call; a slot whose call just ended is held until end_session
    queue_length: int = 0
    ticks: int = 0
    tick_p50_ms: float = 0.0
    tick_p99_ms: float = 0.0
    realtime_factor: float = 0.0  # mean tick compute / tick budget
    latency_p50_ms: float = 0.0  # frame pushed -> matching output frame available
    latency_p99_ms: float = 0.0
    added_latency_p50_ms: float = 0.0  # the same latency minus the engine.step time of its tick
    added_latency_p99_ms: float = 0.0
    headroom_ms: float = 0.0  # tick budget left with one more call (negative: over); serving/headroom.py
    admitting: int = 0  # 1 while a new caller would be seated now (summed: engines taking calls)
    media_lag_ms: float = 0.0  # the worst event-loop lag a door reported lately
    # Calls in the room now (waiting, preparing or live), by the door they came through (serving/room.py).
    calls_by_door: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (
            f"live {self.slots_live}/{self.slots_total} prefill {self.slots_prefill} "
            f"queue {self.queue_length} | "
            f"ticks {self.ticks} p50 {self.tick_p50_ms:.1f} ms p99 {self.tick_p99_ms:.1f} ms "
            f"rtf {self.realtime_factor:.2f} overruns {self.overruns} resyncs {self.resyncs} "
            f"headroom {self.headroom_ms:.0f} ms{'' if self.admitting else ' (holding callers)'} | "
            f"latency p50 {self.latency_p50_ms:.1f} ms p99 {self.latency_p99_ms:.1f} ms "
            f"(added p50 {self.added_latency_p50_ms:.1f} p99 {self.added_latency_p99_ms:.1f}) | "
            f"underruns {self.underruns} input drops {self.input_drops} output drops {self.output_drops} "
            f"engine errors {self.engine_errors}"
        )


def tell_listeners(listeners: list[TickListener], samples: list[tuple[float, list[float]]]) -> None:
    """Each (tick seconds, frame latencies) sample to each listener; one that fails is logged."""
    for listener in listeners:
        try:
            for seconds, latencies in samples:
                listener(seconds, latencies)
        except Exception:
            logger.exception("tick listener failed")


class PoolWindows:
    """The most recent tick times and frame latencies (`add_tick`: under the pool's lock), and
    the listeners told of every tick (outside it)."""

    def __init__(self) -> None:
        self.ticks: collections.deque[float] = collections.deque(maxlen=TICK_WINDOW)
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.added: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        # Called after every step on the ticker thread, so quick (a histogram update); unlike the
        # windows above, a listener sees every sample, however long between two readers.
        self.listeners: list[TickListener] = []

    def add_tick(self, seconds: float, latencies: list[float], step_seconds: float) -> None:
        self.ticks.append(seconds)
        self.latencies.extend(latencies)
        self.added.extend(latency - step_seconds for latency in latencies)

    def sample(self) -> WindowSample:
        """A copy to compute percentiles from outside the lock."""
        return WindowSample(np.fromiter(self.ticks, dtype=np.float64),
                            np.fromiter(self.latencies, dtype=np.float64),
                            np.fromiter(self.added, dtype=np.float64))


@dataclass(frozen=True)
class WindowSample:
    ticks: np.ndarray  # seconds
    latencies: np.ndarray
    added: np.ndarray

    def metrics(self, seating: dict[str, Any], counters: dict[str, Any], tick_count: int, tick_seconds: float
                ) -> PoolMetrics:
        """The figures of these windows, the seating (`SlotTable.figures`) and the counters (`plain`)."""
        def ms(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q) * 1e3) if values.size else 0.0

        ticks, lat, added = self.ticks, self.latencies, self.added
        return PoolMetrics(
            ticks=tick_count, tick_p50_ms=ms(ticks, 50), tick_p99_ms=ms(ticks, 99),
            realtime_factor=float(ticks.mean() / tick_seconds) if ticks.size else 0.0,
            latency_p50_ms=ms(lat, 50), latency_p99_ms=ms(lat, 99),
            added_latency_p50_ms=ms(added, 50), added_latency_p99_ms=ms(added, 99), **seating, **counters,
        )
