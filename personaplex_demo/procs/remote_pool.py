"""The engine as seen from another process: start a call, push frames, pull outputs, end it.

`CallHandler` talks to "a pool": anything with `acquire(voice, persona, sampling)` (plain or
awaitable) returning a call, plus `slots_total`, `config.max_queue` and `snapshot()`. In one
process that is the `SlotPool` itself. Here are the same surfaces for a pool that lives in
another process (`engine_server.EngineServer` serves it):

- `RemoteEngine`: one engine, over one `ipc.Channel` (an AF_UNIX socket with an authkey);
- `RemoteCall`: a call on it, with `Call`'s public surface (state, queue_position, slot,
  end_reason, time_left, push_frame, next_output, wait_live, release);
- `EngineRouter`: several engines as one pool; a call goes to an engine with a free slot, else
  to the shortest queue.

The wire protocol (tuples; only numpy frames and small dicts cross):

    client -> engine   ("start", rid, voice, persona, sampling dict, may_queue)
                       ("push", rid, int16 or float32 frame [1920])
                       ("release", rid, reason)
    engine -> client   ("hello", {"name", "slots_total", "config", "room", ...})   once, first
                       ("started", rid, call id, state, queue position, slot, time left)
                       ("refused", rid, kind, message)    kind: caller | busy | full | closed
                       ("state", rid, state, queue position, slot, time left, end reason)
                       ("out", rid, float32 pcm [1920], text, tick)
                       ("room", PoolMetrics dict, [(tick seconds, [frame latencies])])
                                                           twice a second: the figures, and every
                                                           tick since the last time (for /metrics)

`rid` is chosen by the client and names the call from then on. Everything a RemoteEngine and its
calls do after the first `acquire` happens on that call's event loop: use one loop per client.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Client
from typing import Any

import numpy as np

from ..errors import CallerError
from ..frame import FRAME_SAMPLES
from ..sampling_params import SamplingParams
from ..serving.call import CallView, checked_frame
from ..serving.config import PoolConfig
from ..serving.metrics import PoolMetrics, tell_listeners
from ..serving.room import CallEnded, CallState, EndReason, PoolClosedError, PoolFullError, SlotOutput
from .channel import Channel

log = logging.getLogger(__name__)

START_TIMEOUT = 15.0  # seconds an engine may take to answer a start (it is one dict lookup away)
ENGINE_LOST = EndReason.error("the engine process stopped")
START_TIMED_OUT = EndReason.error("start timed out")
DEFAULT_SAMPLING = SamplingParams()


class RemoteCall(CallView):
    """One call on a `RemoteEngine`, driven by the engine's messages; see `pool.Call`."""

    def __init__(self, engine: RemoteEngine, rid: int, call_id: str, state: str, queue_position: int | None,
                 slot: int | None, time_left: float | None) -> None:
        super().__init__(call_id)
        self.engine = engine
        self.rid = rid
        self.frames_pushed = 0
        self._deadline: float | None = None
        self._outbox: collections.deque[SlotOutput] = collections.deque(maxlen=engine.config.output_queue_frames)
        self._changed = asyncio.Event()
        self.update(state, queue_position, slot, time_left, None)

    def __repr__(self) -> str:
        return f"RemoteCall({self.id}@{self.engine.name}, {self.state}, slot={self.slot}, queue={self.queue_position})"

    def time_left(self) -> float | None:
        if self.state != CallState.LIVE or self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def push_frame(self, frame: np.ndarray) -> None:
        """Queue one 1920-sample frame for the engine. Dropped unless live; never blocks."""
        arr = checked_frame(frame, FRAME_SAMPLES)  # sent as it is: int16 is half the bytes of float32
        if self.state != CallState.LIVE:
            return
        self.frames_pushed += 1
        self.engine.send(("push", self.rid, arr.copy()))

    def release(self, reason: str = EndReason.HANGUP) -> None:
        """End the call (idempotent). The engine frees the slot."""
        if self.state == CallState.ENDED:
            return
        self.engine.send(("release", self.rid, str(reason)))  # a plain string on the wire
        self.update(CallState.ENDED, None, self.slot, None, reason)

    async def wait_live(self, timeout: float | None = None) -> None:
        """Return once live; raise CallEnded if it ended first, TimeoutError after `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self.state == CallState.LIVE:
                return
            if self.state == CallState.ENDED:
                raise CallEnded(self.end_reason or "ended")
            await self._wait(deadline, loop, raise_timeout=True)

    async def next_output(self, timeout: float) -> SlotOutput | None:
        """The next output frame; None after `timeout` s without one; CallEnded once ended and drained."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._outbox:
                return self._outbox.popleft()
            if self.state == CallState.ENDED:
                raise CallEnded(self.end_reason or "ended")
            if not await self._wait(deadline, loop, raise_timeout=False):
                return None

    async def _wait(self, deadline: float | None, loop: asyncio.AbstractEventLoop, raise_timeout: bool) -> bool:
        changed = self._changed
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            if raise_timeout:
                raise TimeoutError
            return False
        try:
            await asyncio.wait_for(changed.wait(), remaining)
        except TimeoutError:
            if raise_timeout:
                raise
            return False
        return True

    # ---- the engine's side (on the call's event loop) ----------------------------------------

    def update(self, state: str, queue_position: int | None, slot: int | None, time_left: float | None,
                end_reason: str | None) -> None:
        if self.state == CallState.ENDED:
            return  # released here first: the engine's late news changes nothing
        self.state, self.queue_position, self.slot = CallState(state), queue_position, slot
        if self.state == CallState.ENDED:
            self.end_reason = end_reason or "ended"
            self.queue_position = None
        if time_left is not None:
            self._deadline = time.monotonic() + time_left
        self._wake()

    def deliver(self, out: SlotOutput) -> None:
        if self.state != CallState.LIVE:
            return  # released meanwhile: nobody reads it
        self._outbox.append(out)  # a full box drops its oldest frame, as the pool does
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


_REFUSALS: dict[str, type[Exception]] = {"caller": CallerError, "busy": PoolFullError, "full": PoolFullError,
                                         "closed": PoolClosedError}


class RemoteEngine:
    """One SlotPool in another process (or, later, on another machine)."""

    def __init__(self, address: str, authkey: bytes, name: str | None = None) -> None:
        conn = Client(address, family="AF_UNIX", authkey=authkey)
        tag, info = conn.recv()
        if tag != "hello":
            raise RuntimeError(f"engine at {address} answered {tag!r} instead of hello")
        self.address = address
        self.info: dict[str, Any] = info
        self.name: str = name or info.get("name", address)
        self.slots_total: int = int(info["slots_total"])
        self.config = PoolConfig(**info["config"])
        self.room = PoolMetrics(**info["room"])
        self.alive = True
        self._tick_listeners: list[Callable[[float, list[float]], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._calls: dict[int, RemoteCall] = {}
        self._channel = Channel(conn, f"engine-client:{self.name}", self._on_batch, self._on_close).start()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.name}, {'alive' if self.alive else 'gone'})"

    def snapshot(self) -> PoolMetrics:
        return self.room

    def add_tick_listener(self, listener: Callable[[float, list[float]], None]) -> None:
        """As `SlotPool.add_tick_listener`, but called on this client's reader thread, twice a
        second for the ticks in between."""
        self._tick_listeners.append(listener)

    def send(self, message: tuple) -> None:
        self._channel.send(message)

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      queue: bool = True) -> RemoteCall:
        """Start a call: a free slot (state PREFILL) or a place in the queue (state QUEUED).
        Raises what `SlotPool.acquire` raises."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("a RemoteEngine serves the calls of one event loop")
        if not self.alive:
            raise PoolClosedError(f"engine {self.name} is not running")
        rid = next(self._rids)
        fut: asyncio.Future[RemoteCall] = loop.create_future()
        self._pending[rid] = fut
        self.send(("start", rid, voice, persona, dataclasses.asdict(sampling), queue))
        try:
            return await asyncio.wait_for(fut, START_TIMEOUT)
        except TimeoutError:
            self.send(("release", rid, START_TIMED_OUT))  # in case it was placed after all
            raise PoolClosedError(f"engine {self.name} did not answer within {START_TIMEOUT:.0f} s") from None
        finally:
            self._pending.pop(rid, None)

    def close(self) -> None:
        self.alive = False  # said goodbye: not an error
        self._channel.close()

    # ---- messages ------------------------------------------------------------------------------

    def _on_batch(self, batch: list[tuple]) -> None:
        """Reader thread: room figures are kept at once; everything else goes to the loop."""
        rest = []
        for message in batch:
            if message[0] == "room":
                self.room = PoolMetrics(**message[1])
                tell_listeners(self._tick_listeners, message[2])
            else:
                rest.append(message)
        loop = self._loop
        if rest and loop is not None:
            try:
                loop.call_soon_threadsafe(self._dispatch, rest)
            except RuntimeError:
                pass  # that loop has closed: nobody is left to tell

    def _dispatch(self, messages: list[tuple]) -> None:
        for message in messages:
            tag, rid = message[0], message[1]
            call = self._calls.get(rid)
            if tag == "out" and call is not None:
                call.deliver(SlotOutput(message[2], message[3], message[4]))
            elif tag == "state" and call is not None:
                call.update(*message[2:])
                if call.state == CallState.ENDED:
                    self._calls.pop(rid, None)
            elif tag == "started":
                call = RemoteCall(self, rid, *message[2:])
                fut = self._pending.get(rid)
                if fut is None or fut.done():
                    call.release(START_TIMED_OUT)
                    continue
                if call.state != CallState.ENDED:
                    self._calls[rid] = call
                fut.set_result(call)
            elif tag == "refused":
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(_REFUSALS.get(message[2], RuntimeError)(message[3]))

    def _on_close(self) -> None:
        if self.alive:
            self.alive = False
            log.error("engine %s: connection lost; ending its calls", self.name)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._end_everything)
            except RuntimeError:
                pass

    def _end_everything(self) -> None:
        for call in list(self._calls.values()):
            call.update(CallState.ENDED, None, call.slot, None, ENGINE_LOST)
        self._calls.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PoolClosedError(f"engine {self.name} stopped"))


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


class EngineRouter:
    """Several engines as one pool. A call goes to an engine with a free slot (the freest
    first); when none has one, into the shortest queue. Engines that stopped are skipped."""

    def __init__(self, engines: list[RemoteEngine]) -> None:
        if not engines:
            raise ValueError("an EngineRouter needs at least one engine")
        self.engines = list(engines)
        queues = [e.config.max_queue for e in self.engines]
        self.config = dataclasses.replace(self.engines[0].config,
                                          max_queue=None if None in queues else sum(queues))

    @property
    def slots_total(self) -> int:
        return sum(e.slots_total for e in self.engines if e.alive)

    def snapshot(self) -> PoolMetrics:
        return combine_metrics([e.snapshot() for e in self.engines if e.alive])

    def add_tick_listener(self, listener: Callable[[float, list[float]], None]) -> None:
        for engine in self.engines:
            engine.add_tick_listener(listener)

    def engine_status(self) -> list[dict[str, Any]]:
        """Per engine, for /api/status: its name, whether it runs, and its pool's figures."""
        return [{"name": e.name, "alive": e.alive, **e.snapshot().as_dict()} for e in self.engines]

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING) -> RemoteCall:
        alive = [e for e in self.engines if e.alive]
        if not alive:
            raise PoolClosedError("no engine is running")
        # A free slot anywhere first: each engine takes the call only if it has one, atomically.
        for engine in sorted(alive, key=lambda e: (-e.room.slots_free, e.room.queue_length)):
            try:
                return await engine.acquire(voice, persona, sampling, queue=False)
            except (PoolFullError, PoolClosedError):
                continue
        full: PoolFullError | None = None
        for engine in sorted((e for e in alive if e.alive), key=lambda e: e.room.queue_length):
            try:
                return await engine.acquire(voice, persona, sampling, queue=True)
            except PoolFullError as exc:
                full = exc
            except PoolClosedError:
                continue
        if full is not None:
            raise PoolFullError(f"all {self.slots_total} slots busy and every queue is full; try again in a minute")
        raise PoolClosedError("no engine is taking calls")

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
