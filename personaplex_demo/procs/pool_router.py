"""Several engines' slot pools as one `Room`: placement across them (`PoolRouter`).

The engines may be processes on this machine (`--devices`, `--media-workers`) or Ray actors on
other machines (`--engines ray`, procs/ray/); either way each is a `RemotePool` here. An engine
that stopped is skipped, and one that came back (a restarted Ray actor) takes its place
(`replace`). Callers who find every engine full wait in the router's one queue
(routed_call.py), not at one engine: the first slot freed anywhere goes to the head of it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..errors import CallerError
from ..sampling_params import SamplingParams
from ..serving.headroom import WAIT_CAPACITY, WAIT_SLOTS
from ..serving.metrics import PoolMetrics
from ..serving.room import DOOR_PAGE, CallState, EndReason, PoolClosedError, PoolFullError, TickListener
from .remote_pool import DEFAULT_SAMPLING, RemoteCall, RemotePool
from .routed_call import RoutedCall

log = logging.getLogger(__name__)

PLACE_SECONDS = 0.1  # the queue's head asks again this often (only engines whose figures show a free slot)
NO_ENGINE = EndReason.error("no engine is running")


def combine_metrics(metrics: list[PoolMetrics]) -> PoolMetrics:
    """One room out of several engines: counts add up, latencies and tick times take the worst."""
    if not metrics:
        return PoolMetrics(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0.0, 0.0)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(PoolMetrics):
        column = [getattr(m, f.name) for m in metrics]
        if isinstance(column[0], dict):  # counts by reason
            values[f.name] = dict(sum((collections.Counter(c) for c in column), collections.Counter()))
        else:
            values[f.name] = max(column) if isinstance(column[0], float) else sum(column)
    return PoolMetrics(**values)


class UnreachableEngine:
    """An engine on another machine that did not answer when this process started (its machine
    may be gone): placement skips it until a link to it is made (`PoolRouter.replace`)."""

    alive = False
    slots_total = 0
    config = None

    def __init__(self, address: Any, name: str) -> None:
        self.address, self.name, self.facts = address, name, {}
        self.room = combine_metrics([])

    def snapshot(self) -> PoolMetrics:
        return self.room

    def add_tick_listener(self, listener: TickListener) -> None:
        pass

    def report_media_lag(self, seconds: float, source: str = "") -> None:
        pass

    def close(self) -> None:
        pass


class PoolRouter:
    """Several engines' pools as one `Room`. A call goes to an engine that takes it now (a free
    slot with headroom in its tick, serving/headroom.py), the one with the most headroom first.
    When none does, it waits in the router's one queue (`RoutedCall`), and the head of that queue
    takes the first seat that any engine frees. Engines that stopped are skipped."""

    def __init__(self, engines: list[RemotePool | UnreachableEngine]) -> None:
        if not engines:
            raise ValueError("a PoolRouter needs at least one engine")
        self.engines = list(engines)
        # Every engine has the app's settings (the first one linked says them); the queue is the router's.
        self.config = next((e.config for e in self.engines if e.alive), self.engines[0].config)
        self._tick_listeners: list[TickListener] = []
        self._waiting: list[RoutedCall] = []
        self._placer: asyncio.Task | None = None
        self._counts = collections.Counter[str]()  # refused, held back, and ended in this queue by reason
        self.on_waiting: Callable[[int], None] | None = None  # told the queue's length when it changes
        self.waiting_elsewhere: Callable[[], int] = lambda: 0  # the media workers' routers' queues
        self._reason = WAIT_SLOTS  # why the queue waits: no slot anywhere, or no headroom where one is free
        self._told = 0

    @property
    def slots_total(self) -> int:
        return sum(e.slots_total for e in self.engines if e.alive)

    def snapshot(self) -> PoolMetrics:
        m = combine_metrics([e.snapshot() for e in self.engines if e.alive])
        ended = collections.Counter(m.calls_ended)
        ended.update({k.removeprefix("ended:"): v for k, v in self._counts.items() if k.startswith("ended:")})
        waiting = len(self._waiting) + self.waiting_elsewhere()
        return dataclasses.replace(m, queue_length=m.queue_length + waiting, calls_ended=dict(ended),
                                   calls_refused=m.calls_refused + self._counts["refused"],
                                   calls_held_back=m.calls_held_back + self._counts["held_back"])

    def add_tick_listener(self, listener: TickListener) -> None:
        self._tick_listeners.append(listener)
        for engine in self.engines:
            engine.add_tick_listener(listener)

    def replace(self, old: RemotePool, new: RemotePool) -> None:
        """An engine that came back (a restarted Ray actor) in place of its stopped self: new
        calls may go to it; the old one's calls have ended."""
        for listener in self._tick_listeners:
            new.add_tick_listener(listener)
        # A new list, not an edit: the doors' loops iterate the old one meanwhile.
        self.engines = [new if e is old else e for e in self.engines]

    def report_media_lag(self, seconds: float, source: str = "") -> None:
        for engine in self.engines:
            engine.report_media_lag(seconds, source)

    def engine_status(self) -> list[dict[str, Any]]:
        """Per engine, for /api/status: its name, where it runs, whether it runs, and its pool's figures."""
        return [{"name": e.name, "node": e.facts.get("node"), "device": e.facts.get("device"), "alive": e.alive,
                 **e.snapshot().as_dict()} for e in self.engines]

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE) -> RemoteCall | RoutedCall:
        """The room contract's `acquire`, across the engines that run; raises what `SlotPool.acquire` does."""
        if not any(e.alive for e in self.engines):
            raise PoolClosedError("no engine is running")
        if len(self.engines) == 1:  # its own queue is the one queue, shared with every other door and worker
            return await self.engines[0].acquire(voice, persona, sampling, door, queue=True)
        queued = sum(c.state == CallState.QUEUED for c in self._waiting)  # not those who just hung up
        if not queued:  # nobody waits: a seat anywhere, if an engine has one now
            call = await self._seat(voice, persona, sampling, door, [e for e in self.engines if e.alive])
            if call is not None:
                return call
        if self.config.max_queue is not None and queued >= self.config.max_queue:
            self._counts["refused"] += 1
            raise PoolFullError(f"all {self.slots_total} slots busy and the queue is full; try again in a minute")
        waiting = RoutedCall(voice, persona, sampling, door)
        self._hold(waiting, self._reason)
        self._waiting.append(waiting)
        self._renumber()
        log.info("call %s (%s): queued at position %d across %d engine(s)", waiting.id, door, waiting.position,
                 len(self.engines))
        if self._placer is None or self._placer.done():
            self._placer = asyncio.get_running_loop().create_task(self._place_waiting())
        return waiting

    async def _seat(self, voice: str, persona: str, sampling: SamplingParams, door: str,
                    engines: list[RemotePool]) -> RemoteCall | None:
        """A seat now on one of `engines` (the most room first), or None. Each engine decides
        atomically: two routers cannot both count on one free slot."""
        for engine in sorted(engines, key=lambda e: (-e.room.admitting, -e.room.headroom_ms, -e.room.slots_free)):
            try:
                return await engine.acquire(voice, persona, sampling, door, queue=False)
            except (PoolFullError, PoolClosedError):
                continue
        return None

    async def _place_waiting(self) -> None:
        """The queue's head takes the first seat an engine frees (their figures say where to ask)."""
        while self._waiting:
            for gone in [c for c in self._waiting if c.state == CallState.ENDED]:  # hung up, or waited too long
                self._counts[f"ended:{EndReason.kind(gone.end_reason or 'ended')}"] += 1
                self._waiting.remove(gone)
            self._renumber()
            if not self._waiting:
                return
            head = self._waiting[0]
            if not any(e.alive for e in self.engines):
                for call in self._waiting:
                    call.end(NO_ENGINE)
                continue
            free = [e for e in self.engines if e.alive and e.room.slots_free > 0]
            reason = WAIT_CAPACITY if free else WAIT_SLOTS
            if reason != self._reason:
                self._reason = reason
                for call in self._waiting:
                    self._hold(call, reason)
            try:
                seated = await self._seat(head.voice, head.persona, head.sampling, head.door, free) if free else None
            except CallerError as exc:  # a bad request the engine refuses: this caller's alone
                head.end(EndReason.error(exc))
                continue
            if seated is None:
                await asyncio.sleep(PLACE_SECONDS)
            elif head.state == CallState.ENDED:  # hung up while the engine was seating it
                seated.release(head.end_reason or EndReason.HANGUP)
            else:
                self._waiting.remove(head)
                head.seat(seated)
                self._renumber()

    def _hold(self, call: RoutedCall, reason: str) -> None:
        """Why it waits; a call held back for headroom (a slot free somewhere) counts once."""
        if reason == WAIT_CAPACITY and not call.held_back:
            call.held_back = True
            self._counts["held_back"] += 1
        if call.waiting_for != reason:
            call.waiting_for = reason
            call.moved()

    def _renumber(self) -> None:
        for position, call in enumerate(self._waiting, 1):
            if call.position != position:
                call.position = position
                call.moved()
        if self.on_waiting is not None and len(self._waiting) != self._told:
            self._told = len(self._waiting)
            self.on_waiting(self._told)

    def close(self) -> None:
        """Close every link (their calls end); the callers still waiting here are told, on their loop."""
        placer = self._placer
        if placer is not None and not placer.done():
            def end_waiting() -> None:
                placer.cancel()
                for call in self._waiting:
                    call.end(NO_ENGINE)

            try:
                placer.get_loop().call_soon_threadsafe(end_waiting)
            except RuntimeError:
                pass  # that loop has closed
        for engine in self.engines:
            engine.close()
