"""Several engines' slot pools as one `Room` (`PoolRouter`), one per app in the main process: every door's
and media worker's caller waits in its one queue, first come, first served; only control passes through it
(docs/processes.md, "One room, one queue")."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..call_settings import SamplingParams
from ..errors import CallerError
from ..serving.config import PoolConfig
from ..serving.headroom import WaitReason
from ..serving.metrics import PoolMetrics, TickListener
from ..serving.room import DOOR_PAGE, CallHandle, CallState, EndReason, PoolClosedError, PoolFullError
from ..serving.waiting import queue_expiry
from .engine_link import DEFAULT_SAMPLING, EngineLink
from .routed_call import RoutedCall

log = logging.getLogger(__name__)

PLACE_SECONDS = 0.1  # the queue's head asks again this often (only engines whose figures show a free slot)
NO_ENGINE = EndReason.error("no engine is running")


def combine_metrics(metrics: list[PoolMetrics]) -> PoolMetrics:
    """One room out of several engines: counts add up, latencies and tick times take the worst."""
    if not metrics:
        return PoolMetrics()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(PoolMetrics):
        column = [getattr(m, f.name) for m in metrics]
        if isinstance(column[0], dict):  # counts by reason
            values[f.name] = dict(sum((collections.Counter(c) for c in column), collections.Counter()))
        else:
            values[f.name] = max(column) if isinstance(column[0], float) else sum(column)
    return PoolMetrics(**values)


class UnreachableEngine:
    """An engine on another machine that did not answer at start (its machine may be gone): placement
    skips it until a link to it is made (`EngineSet.replace`)."""

    alive = False
    slots_total = 0
    config = PoolConfig()  # its own is learnt with the link; the router's comes from the engines that answer

    def __init__(self, address: Any, name: str) -> None:
        self.address, self.name, self.facts = address, name, {}
        self.figures = combine_metrics([])

    def snapshot(self) -> PoolMetrics:
        return self.figures

    def add_tick_listener(self, listener: TickListener) -> None:
        pass

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        pass

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE, *, queue: bool = True) -> CallHandle:
        raise PoolClosedError(f"engine {self.name} is not reachable")

    def close(self) -> None:
        pass


class RequestRules(Protocol):
    """What the router checks a request against before a caller waits for a seat (the engines'
    facts): a bad one is refused at once, not when its turn comes."""

    def validate_request(self, voice: str, persona: str, sampling: SamplingParams) -> None: ...


class EngineSet:
    """The engine links of both rooms built on them (`PoolRouter`, `queue_desk.DeskRoom`): the app's
    settings, their slots and figures, and the tick listeners, kept across a link made again (`replace`)."""

    def __init__(self, engines: list[EngineLink | UnreachableEngine]) -> None:
        if not engines:
            raise ValueError("a room needs at least one engine")
        self.engines = list(engines)
        # Every engine has the app's settings (the first one linked says them).
        self.config = next((e.config for e in self.engines if e.alive), self.engines[0].config)
        self._tick_listeners: list[TickListener] = []

    @property
    def slots_total(self) -> int:
        return sum(e.slots_total for e in self.engines if e.alive)

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE) -> CallHandle:
        """The room contract's `acquire`: a seat, or a place in the room's one queue (`enter`)."""
        if len(self.engines) == 1:  # its own queue is the one queue, shared with every other door and worker
            return await self.engines[0].acquire(voice, persona, sampling, door, queue=True)
        call = RoutedCall(voice, persona, sampling, door)
        await self.enter(call)
        return call.inner if call.inner is not None else call

    async def enter(self, call: RoutedCall) -> None:
        raise NotImplementedError

    def engines_figures(self) -> PoolMetrics:
        return combine_metrics([e.snapshot() for e in self.engines if e.alive])

    def add_tick_listener(self, listener: TickListener) -> None:
        self._tick_listeners.append(listener)
        for engine in self.engines:
            engine.add_tick_listener(listener)

    def replace(self, old: EngineLink | UnreachableEngine, new: EngineLink) -> None:
        """A new link in place of a lost one (a restarted Ray actor, or one that answers at last)."""
        for listener in self._tick_listeners:
            new.add_tick_listener(listener)
        # A new list, not an edit: the doors' loops iterate the old one meanwhile.
        self.engines = [new if e is old else e for e in self.engines]

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        for engine in self.engines:
            engine.report_media_lag(seconds, source)

    def close_links(self) -> None:
        for engine in self.engines:
            engine.close()


class PoolRouter(EngineSet):
    """Several engines' pools as one `Room`. A call goes to an engine that takes it now (a free slot with
    headroom, serving/headroom.py), the most headroom first; else it waits in the one queue (`RoutedCall`),
    whose head takes the first seat any engine frees. Engines that stopped are skipped."""

    def __init__(self, engines: list[EngineLink | UnreachableEngine], rules: RequestRules | None = None) -> None:
        super().__init__(engines)
        self.rules = rules
        self._waiting: list[RoutedCall] = []  # in order of arrival
        self._arrivals = itertools.count(1)
        self._placer: asyncio.Task | None = None
        self._counts = collections.Counter[str]()  # refused, held back, and ended in this queue by reason
        self._reason = WaitReason.SLOTS  # why the queue waits: no slot anywhere, or no headroom where one is free
        self.on_queued: Callable[[int], None] | None = None  # the media workers' pages show the queue's length
        self._told = 0

    def snapshot(self) -> PoolMetrics:
        m = self.engines_figures()
        ended = collections.Counter(m.calls_ended)
        ended.update({k.removeprefix("ended:"): v for k, v in self._counts.items() if k.startswith("ended:")})
        return dataclasses.replace(m, queue_length=m.queue_length + self.queued, calls_ended=dict(ended),
                                   calls_refused=m.calls_refused + self._counts["refused"],
                                   calls_held_back=m.calls_held_back + self._counts["held_back"])

    @property
    def queued(self) -> int:
        """Callers in the queue (not those who just hung up)."""
        return sum(c.state == CallState.QUEUED for c in self._waiting)

    def engine_status(self) -> list[dict[str, Any]]:
        """Per engine, for /api/status: its name, where it runs, whether it runs, and its pool's figures."""
        return [{"name": e.name, "node": e.facts.get("node"), "device": e.facts.get("device"), "alive": e.alive,
                 **e.snapshot().as_dict()} for e in self.engines]

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE) -> CallHandle:
        if not any(e.alive for e in self.engines):
            raise PoolClosedError("no engine is running")
        return await super().acquire(voice, persona, sampling, door)

    async def enter(self, call: RoutedCall) -> None:
        """Seat `call` on an engine now, or give it its place in the queue, whatever door or process it came
        from. CallerError for a bad request, PoolFullError when the queue is full, PoolClosedError with no engine."""
        alive = [e for e in self.engines if e.alive]
        if not alive:
            raise PoolClosedError("no engine is running")
        if self.rules is not None:
            self.rules.validate_request(call.voice, call.persona, call.sampling)
        call.arrival = next(self._arrivals)
        if not self.queued and await self._seat(call, alive):  # nobody waits: a seat anywhere, if one is free
            return
        if self.config.max_queue is not None and self.queued >= self.config.max_queue:
            self._counts["refused"] += 1
            why = self._reason if self._reason == WaitReason.CAPACITY else f"all {self.slots_total} slots busy"
            raise PoolFullError(f"{why} and the queue of {self.config.max_queue} is full; try again in a minute",
                                self._reason)
        bisect.insort(self._waiting, call, key=lambda c: c.arrival)  # after a missed seat, ahead of later ones
        self._renumber()
        log.info("call %s (%s): queued at position %d across %d engine(s)", call.id, call.door, call.position,
                 len(self.engines))
        if self._placer is None or self._placer.done():
            self._placer = asyncio.get_running_loop().create_task(self._place_waiting())

    async def _seat(self, call: RoutedCall, engines: list[EngineLink]) -> bool:
        """A seat now for `call` on one of `engines` (the most room first): True once it needs no more seating."""
        numbered = [(i, e) for i, e in enumerate(self.engines) if e in engines]  # before any await: `replace`
        numbered.sort(key=lambda ie: (-ie[1].figures.admitting, -ie[1].figures.headroom_ms, -ie[1].figures.slots_free))
        for index, engine in numbered:
            if await call.take(engine, index):
                return True
        return False

    async def _place_waiting(self) -> None:
        """The queue's rules (wait limit, silence) on the router's clock, and seats for its head, until it is empty."""
        while self._waiting:
            try:
                await self._place_head()
            except Exception:  # a bug here must not stop the queue: its rules and its seats
                log.exception("placing the queue's head failed; trying again")
                await asyncio.sleep(PLACE_SECONDS)
        self._renumber()

    async def _place_head(self) -> None:
        """One look at the queue: its rules, then a seat for its head if an engine's figures show one."""
        now = time.monotonic()
        for call in self._waiting:
            if call.state == CallState.QUEUED and (why := queue_expiry(self.config, now, call.queued_at)):
                log.info("call %s ended in the queue: %s", call.id, why)
                call.end(why)
        for gone in [c for c in self._waiting if c.state == CallState.ENDED]:  # hung up, or waited too long
            self._counts[f"ended:{EndReason.kind(gone.end_reason or 'ended')}"] += 1
            self._waiting.remove(gone)
        if not self._waiting:
            return
        head = self._waiting[0]
        if not any(e.alive for e in self.engines):
            for call in self._waiting:
                call.end(NO_ENGINE)
            return
        free = [e for e in self.engines if e.alive and e.figures.slots_free > 0]
        # A free slot its engine does not admit to is a lack of capacity; one it admits to but did
        # not give (the figures are half a second old) was taken meanwhile.
        self._reason = WaitReason.CAPACITY if any(not e.figures.admitting for e in free) else WaitReason.SLOTS
        self._renumber()
        try:
            seated = await self._seat(head, free) if free else False
        except CallerError as exc:  # a bad request the engine refuses: this caller's alone
            head.end(EndReason.error(exc))
            return
        if not seated:
            await asyncio.sleep(PLACE_SECONDS)
        elif head in self._waiting and head.state != CallState.ENDED:
            self._waiting.remove(head)

    def _renumber(self) -> None:
        """Places from 1 for those still waiting, and why; `on_queued` hears the queue's length when it changes."""
        waiting = [c for c in self._waiting if c.state == CallState.QUEUED]
        for position, call in enumerate(waiting, 1):
            if self._reason == WaitReason.CAPACITY and not call.held_back:
                call.held_back = True
                self._counts["held_back"] += 1
            call.moved(position, self._reason)
        if len(waiting) != self._told and self.on_queued is not None:
            self.on_queued(len(waiting))
        self._told = len(waiting)

    def close(self) -> None:
        """Close every link (their calls end); the callers still waiting here are told, on their loop."""
        placer = self._placer
        if placer is not None and not placer.done():
            def end_waiting() -> None:
                placer.cancel()
                for call in self._waiting:
                    call.end(NO_ENGINE)

            with contextlib.suppress(RuntimeError):  # that loop has closed
                placer.get_loop().call_soon_threadsafe(end_waiting)
        self.close_links()
