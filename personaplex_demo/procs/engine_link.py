"""An engine in another process as a `Room`: `EngineLink` over a `channel.Channel` to its `PoolServer`,
`RemoteCall`, a call on it, and `SilenceWatchdog`, which gives up on a link gone silent. After the first
`acquire` everything happens on that call's event loop: use one loop per client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..call_settings import SamplingParams
from ..errors import CallerError
from ..serving.call import checked_audio
from ..serving.config import PoolConfig
from ..serving.headroom import WaitReason
from ..serving.metrics import PoolMetrics, tell_listeners
from ..serving.room import DOOR_PAGE, CallState, EndReason, PoolClosedError, PoolFullError, SlotOutput, TickListener
from ..serving.waiting import CallView, WaitingCall
from . import messages as msg
from .channel import Address, Channel, open_link
from .tick_gather import TickGather

log = logging.getLogger(__name__)

START_TIMEOUT = 15.0  # seconds an engine may take to answer a start (it is one dict lookup away)
ENGINE_LOST = EndReason.error("the engine process stopped")
START_TIMED_OUT = EndReason.error("start timed out")
WORKER_LOST = EndReason.error("media worker lost")  # its calls, on the engines and in the room's queue
DEFAULT_SAMPLING = SamplingParams()
SILENCE_LIMIT = 1.5  # seconds without a word from a live engine (it speaks every 0.25 s)
SILENCE_CHECK_SECONDS = 0.1


class RemoteCall(CallView, WaitingCall):
    """One call on an `EngineLink` (a `CallHandle`), driven by the engine's messages on the call's event loop."""

    def __init__(self, engine: EngineLink, started: msg.Started) -> None:
        CallView.__init__(self, started.call_id)
        WaitingCall.__init__(self, outbox_frames=engine.config.output_queue_frames)
        self.engine = engine
        self.rid = started.rid
        self.on_change: Callable[[], None] | None = None  # a `RoutedCall` that holds it listens
        self._deadline: float | None = None
        self.update(started)

    def __repr__(self) -> str:
        return f"RemoteCall({self.id}@{self.engine.name}, {self.state}, slot={self.slot}, queue={self.queue_position})"

    def time_left(self) -> float | None:
        if self.state != CallState.LIVE or self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def push_audio(self, samples: np.ndarray) -> None:
        """Send the caller's audio to the engine as it arrived; dropped unless live. Never blocks."""
        arr = checked_audio(samples)  # sent as it is: int16 is half the bytes of float32
        if self.state != CallState.LIVE:
            return
        self.engine.gather.push(self.rid, arr.copy(), time.monotonic())

    def release(self, reason: str = EndReason.HANGUP) -> None:
        """End the call (idempotent). The engine frees the slot."""
        if self.state == CallState.ENDED:
            return
        self.engine.gather.forget(self.rid)
        self.engine.send(msg.Release(self.rid, str(reason)))  # a plain string on the wire
        self.update(msg.StateChange(rid=self.rid, state=CallState.ENDED, slot=self.slot, end_reason=reason))

    # ---- the engine's side -------------------------------------------------------------------

    def update(self, news: msg.StateChange) -> None:
        if self.state == CallState.ENDED:
            return  # released here first: the engine's late news changes nothing
        self.state, self.queue_position, self.slot = CallState(news.state), news.queue_position, news.slot
        queued = news.wait_reason and self.state == CallState.QUEUED
        self.wait_reason = WaitReason(news.wait_reason) if queued else None
        if self.state == CallState.ENDED:
            self.end_reason = news.end_reason or "ended"
            self.queue_position = None
        if news.time_left is not None:
            self._deadline = time.monotonic() + news.time_left
        self._wake()

    def deliver(self, out: SlotOutput) -> None:
        if self.state != CallState.LIVE:
            return  # released meanwhile: nobody reads it
        self._outbox.append(out)  # a full box drops its oldest frame, as the pool does
        self._wake()

    def _wake(self) -> None:
        super()._wake()
        if self.on_change is not None:
            self.on_change()


def refusal(kind: str, message: str, cause: str | None = None) -> Exception:
    """The exception a refusal on the wire (`messages.Refused`) stands for."""
    if kind == "caller":
        return CallerError(message)
    if kind == "full":
        return PoolFullError(message, WaitReason(cause) if cause else WaitReason.SLOTS)
    return PoolClosedError(message)


Refusable = CallerError | PoolFullError | PoolClosedError


def refused(rid: int, exc: Refusable) -> msg.Refused:
    """`exc` on the wire, for `refusal` on the other side."""
    if isinstance(exc, CallerError):
        return msg.Refused(rid, "caller", str(exc))
    if isinstance(exc, PoolFullError):
        return msg.Refused(rid, "full", str(exc), str(exc.cause))
    return msg.Refused(rid, "closed", str(exc))


class EngineLink:
    """One SlotPool in another process (on this machine or another), as a `Room`."""

    def __init__(self, address: Address, authkey: bytes, name: str | None = None) -> None:
        conn, hello = open_link(address, authkey)  # the Hello comes before the server's channel: not a batch
        if not isinstance(hello, msg.Hello):
            conn.close()
            raise RuntimeError(f"engine at {address} answered {type(hello).__name__} instead of Hello")
        self.address = address
        self.facts: dict[str, Any] = hello.facts  # the engine's model name, voices... ({} if it gave none)
        self.name: str = name or hello.name
        self.slots_total: int = hello.slots_total
        self.config = PoolConfig(**hello.config)
        self.figures = PoolMetrics(**hello.figures)
        self.alive = True
        self.heard_at = time.monotonic()  # the engine's last word (`SilenceWatchdog` reads it)
        where = self.facts.get("node")
        self.lost_reason = EndReason.error(f"the engine on {where} stopped") if where else ENGINE_LOST
        self._tick_listeners: list[TickListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._calls: dict[int, RemoteCall] = {}
        self._channel = Channel(conn, f"engine-client:{self.name}", self._on_batch, self._on_close).start()
        self.send: Callable[[msg.ClientMessage], None] = self._channel.send
        self.gather = TickGather(self._channel.send_many, self.config.tick_seconds)  # the callers' audio

    def __repr__(self) -> str:
        return f"EngineLink({self.name}, {'alive' if self.alive else 'gone'})"

    def snapshot(self) -> PoolMetrics:
        return self.figures

    def add_tick_listener(self, listener: TickListener) -> None:
        """As `SlotPool.add_tick_listener`, but called on the reader thread for the ticks since the last figures."""
        self._tick_listeners.append(listener)

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        """Tell the engine how late this process's event loop ran (it names the source itself)."""
        if self.alive:
            self.send(msg.MediaLag(float(seconds)))

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE, *, queue: bool = True) -> RemoteCall:
        """Start a call, as `SlotPool.admit`: with `queue=False`, PoolFullError unless a slot is free (the
        engine decides at once, so two clients cannot both count on one free slot)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = self.gather.loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an EngineLink serves the calls of one event loop")
        if not self.alive:
            raise PoolClosedError(f"engine {self.name} is not running")
        rid = next(self._rids)
        fut: asyncio.Future[RemoteCall] = loop.create_future()
        self._pending[rid] = fut
        self.send(msg.Start(rid, voice, persona, dataclasses.asdict(sampling), may_queue=queue, door=door))
        try:
            call = await asyncio.wait_for(fut, START_TIMEOUT)
        except TimeoutError:
            self.send(msg.Release(rid, START_TIMED_OUT))  # in case it was placed after all
            raise PoolClosedError(f"engine {self.name} did not answer within {START_TIMEOUT:.0f} s") from None
        finally:
            self._pending.pop(rid, None)
        call.door = door  # the engine counts it under its door; the handle says so too
        return call

    def close(self) -> None:
        self.alive = False  # said goodbye: not an error
        self._channel.close()

    def lose(self, why: str) -> None:
        """Give the engine up as gone (it went silent): its calls end as if the connection broke."""
        if self.alive:
            log.error("engine %s: %s", self.name, why)
            self._channel.close()

    # ---- messages ------------------------------------------------------------------------------

    def _on_batch(self, batch: list[msg.ServerMessage]) -> None:
        """Reader thread: the pool's figures are kept at once; everything else goes to the loop."""
        self.heard_at = heard = time.monotonic()
        rest = []
        for message in batch:
            if isinstance(message, msg.PoolFigures):
                self.figures = PoolMetrics(**message.metrics)
                tell_listeners(self._tick_listeners, message.ticks)
            else:
                rest.append(message)
        if rest:
            self._on_loop(self._dispatch, rest, heard)

    def _dispatch(self, messages: list[msg.ServerMessage], heard: float) -> None:
        for message in messages:
            match message:
                case msg.Out(rid=rid):
                    # getattr: an engine of an earlier version sends no plan.
                    self.gather.plan(getattr(message, "next_in", None), heard, message.tick)
                    if (call := self._calls.get(rid)) is not None:
                        call.deliver(SlotOutput(message.pcm, message.text, message.tick, message.latency,
                                                message.input_drops))
                case msg.Started():  # before StateChange: a Started is one
                    self._started(message)
                case msg.StateChange(rid=rid):
                    if (call := self._calls.get(rid)) is not None:
                        call.update(message)
                        if call.state == CallState.ENDED:
                            self._calls.pop(rid, None)
                            self.gather.forget(rid)
                case msg.Refused(rid=rid, kind=kind, message=text, cause=cause):
                    fut = self._pending.get(rid)
                    if fut is not None and not fut.done():
                        fut.set_exception(refusal(kind, text, cause))
                case _:
                    log.warning("engine %s: unexpected %s ignored", self.name, type(message).__name__)

    def _started(self, started: msg.Started) -> None:
        call = RemoteCall(self, started)
        fut = self._pending.get(started.rid)
        if fut is None or fut.done():  # the start timed out here meanwhile: nobody waits for this call
            call.release(START_TIMED_OUT)
            return
        if call.state != CallState.ENDED:
            self._calls[started.rid] = call
        fut.set_result(call)

    def _on_close(self) -> None:
        if self.alive:
            self.alive = False
            log.error("engine %s: connection lost; ending its calls", self.name)
        self._on_loop(self._end_everything)

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """From the reader thread: `callback` on the calls' loop, once there is one."""
        if (loop := self._loop) is not None:
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody is left to tell
                loop.call_soon_threadsafe(callback, *args)

    def _end_everything(self) -> None:
        for call in list(self._calls.values()):
            call.update(msg.StateChange(rid=call.rid, state=CallState.ENDED, slot=call.slot,
                                        end_reason=self.lost_reason))
        self._calls.clear()
        self.gather.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PoolClosedError(f"engine {self.name} stopped"))


class SilenceWatchdog:
    """One thread that gives up on every watched link (`EngineLink.lose`) silent for more than
    SILENCE_LIMIT s: a machine that vanished says no goodbye, and TCP (or Ray's health checks, 15-55 s)
    would notice late. Every engine sends its figures several times a second, even with no call
    (`PoolServer.figures_seconds`), so silence itself is the signal."""

    def __init__(self) -> None:
        self._links: list[EngineLink] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._thread.start()

    def watch(self, link: EngineLink) -> None:
        with self._lock:
            self._links = [w for w in self._links if w.alive] + [link]

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last = grace_until = time.monotonic()
        while not self._stop.wait(SILENCE_CHECK_SECONDS):
            with self._lock:
                links = list(self._links)
            now = time.monotonic()
            if now - last > SILENCE_LIMIT / 2:
                # This process itself stalled (swapping, a long pause): its reader threads stalled
                # too and have not caught up yet. Silence heard through a stall is no evidence.
                grace_until = now + SILENCE_LIMIT
            last = now
            if now < grace_until:
                continue
            for link in links:
                silent = now - link.heard_at
                if link.alive and silent > SILENCE_LIMIT:
                    link.lose(f"no word for {silent:.1f} s (its machine may be gone); ending its calls")
