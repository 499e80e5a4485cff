"""`GET /metrics`: the pool's state and counters in the Prometheus text format.

Gauges and counters are read from `room.snapshot()` at each scrape (a custom collector); the tick and
latency histograms are fed by the ticker through `add_tick_listener`, so no sample is missed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..serving.room import DOOR_PAGE, EndReason, Room

PREFIX = "personaplex"
# One tick is due every 80 ms; the GPU targets are 15 ms (1 slot) to 45 ms (64 slots).
TICK_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.045, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
# Frame pushed -> matching agent frame ready; the engine's own share is one tick.
LATENCY_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)

# Listed with 0 before the first of each happens, so rates and alerts work from the start.
END_REASONS = tuple(reason.value for reason in EndReason)
GAUGES = (  # (name, PoolMetrics field, help, divisor): milliseconds in PoolMetrics are seconds here
    ("slots", "slots_total", "Conversation slots (batch rows) of the engine.", 1),
    ("slots_live", "slots_live", "Slots holding a live call.", 1),
    ("slots_prefilling", "slots_prefill", "Slots preparing a call (voice and persona prompt).", 1),
    ("slots_free", "slots_free", "Slots held by no call.", 1),
    ("queue_length", "queue_length", "Callers waiting for a slot.", 1),
    ("admitting", "admitting", "1 while a new caller would be seated now (a free slot with headroom in the tick).", 1),
    ("tick_headroom_seconds", "headroom_ms",
     "Tick budget (80 ms) left if one more call joined, from the measured tick times; negative: over budget.", 1e3),
    ("media_lag_seconds", "media_lag_ms", "The worst event-loop lag a door (page or media worker) reported lately.",
     1e3),
)
COUNTERS = (
    ("calls_started", "calls_started", "Calls that went live."),
    ("calls_refused", "calls_refused", "Calls refused because every slot and the queue were full."),
    ("calls_held_back", "calls_held_back", "Calls that waited in the queue with a slot free, for lack of headroom."),
    ("engine_errors", "engine_errors", "Exceptions from the engine's step or prefill."),
    ("ticks", "ticks", "Engine steps run."),
    ("tick_overruns", "overruns", "Ticks that finished after their deadline."),
    ("resyncs", "resyncs", "Times the ticker fell too far behind and skipped ahead."),
    ("input_underruns", "underruns", "Ticks where a live call had no microphone frame (silence stood in)."),
    ("input_drops", "input_drops", "Microphone frames dropped from full jitter buffers."),
    ("output_drops", "output_drops", "Agent frames dropped because a caller did not read them in time."),
)


class PoolCollector(Collector):
    """Reads one `pool.snapshot()` per scrape."""

    def __init__(self, room: Room, doors: Sequence[str] = (DOOR_PAGE,)) -> None:
        self.room, self.doors = room, doors  # the doors' labels, each counted from zero

    def collect(self) -> Iterable[Metric]:
        m = self.room.snapshot()
        for name, field, text, divisor in GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=getattr(m, field) / divisor)
        for name, field, text in COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=getattr(m, field))
        ended = CounterMetricFamily(f"{PREFIX}_calls_ended", "Calls ended, by reason.", labels=["reason"])
        in_room = GaugeMetricFamily(f"{PREFIX}_calls", "Calls in the room (waiting, preparing or live), by the "
                                    "door they came through: page (WebRTC) or an API door (/api/status names "
                                    "each).",
                                    labels=["door"])
        started = CounterMetricFamily(f"{PREFIX}_calls_started_by_door", "Calls that went live, by door.",
                                      labels=["door"])
        for family, counts, known in ((ended, m.calls_ended, END_REASONS),
                                      (in_room, m.calls_by_door, self.doors),
                                      (started, m.calls_started_by_door, self.doors)):
            for label, count in sorted({**dict.fromkeys(known, 0), **counts}.items()):
                family.add_metric([label], count)
            yield family


ENGINE_GAUGES = (  # (name, /api/status engine field, help, divisor): per engine, labelled by engine, node and device
    ("engine_slots", "slots_total", "Conversation slots of this engine.", 1),
    ("engine_slots_live", "slots_live", "Slots of this engine holding a live call.", 1),
    ("engine_queue_length", "queue_length", "Callers waiting for a slot of this engine.", 1),
    ("engine_tick_p50_seconds", "tick_p50_ms", "Median tick time of this engine, lately.", 1e3),
)


class EngineCollector(Collector):
    """Per engine (several engine processes, or Ray actors on several machines): whether it is up
    and its load, from `status()` (the engines' rows of /api/status)."""

    def __init__(self, status: Callable[[], list[dict]]) -> None:
        self.status = status

    def collect(self) -> Iterable[Metric]:
        labels = ["engine", "node", "device"]
        up = GaugeMetricFamily(f"{PREFIX}_engine_up", "1 while the engine runs and is linked to this app.",
                               labels=labels)
        gauges = [GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=labels) for name, _, text, _ in ENGINE_GAUGES]
        for row in self.status():
            key = [str(row.get("name")), str(row.get("node")), str(row.get("device"))]
            up.add_metric(key, 1.0 if row.get("alive") else 0.0)
            for family, (_, field, _, divisor) in zip(gauges, ENGINE_GAUGES, strict=True):
                family.add_metric(key, row.get(field, 0) / divisor)
        yield from (up, *gauges)


class VisitorCollector(Collector):
    """Visitors' requests refused (web/visitor_limits.py), by why; calls are never refused there."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        refused = CounterMetricFamily(f"{PREFIX}_visitors_refused", "Visitors' page loads and events refused: over "
                                      "an address's rate (page_loads, events) or with the server behind (busy).",
                                      labels=["why"])
        for key, count in self.counts().items():  # page_loads_refused, events_refused, busy_refused
            refused.add_metric([key.removesuffix("_refused")], count)
        yield refused


def metrics_routes(room: Room, collectors: Sequence[Collector] = (), doors: Sequence[str] = (DOOR_PAGE,)
                   ) -> list[Route]:
    """This pool's metrics plus the process's (memory, CPU, GC), in a registry of their own, not
    prometheus_client's global one, so several pools (tests) never clash."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(room, doors))
    for collector in collectors:  # the other doors' own figures
        registry.register(collector)
    tick = Histogram(f"{PREFIX}_tick_seconds", "Wall time of one tick: the batched engine step and its bookkeeping.",
                     buckets=TICK_BUCKETS, registry=registry)
    latency = Histogram(f"{PREFIX}_frame_latency_seconds",
                        "From a caller's frame entering the pool to the matching agent frame being ready.",
                        buckets=LATENCY_BUCKETS, registry=registry)

    def observe(tick_seconds: float, latencies: list[float]) -> None:
        tick.observe(tick_seconds)
        for value in latencies:
            latency.observe(value)

    room.add_tick_listener(observe)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)

    async def metrics(_: Request) -> Response:
        # A snapshot sorts thousands of samples under the ticker's lock: not on the event loop.
        body = await run_in_threadpool(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})

    return [Route("/metrics", metrics, methods=["GET"])]
