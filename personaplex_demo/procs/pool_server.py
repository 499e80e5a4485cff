"""One SlotPool served to other processes (the engine side of `EngineLink`): a client's frames go straight into
the pool from its channel's reader thread (`Call.push_audio` never blocks); one event loop in a thread of its
own sends each call's outputs and state changes back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import AuthenticationError, Connection
from typing import Any

import numpy as np

from ..call_settings import SamplingParams
from ..errors import CallerError
from ..serving.call import Call
from ..serving.pool import SlotPool
from ..serving.room import CallEnded, CallState, EndReason, PoolClosedError, PoolFullError
from . import messages as msg
from .channel import Address, Channel, accept_link, daemon_threads, listen
from .engine_link import WORKER_LOST, refused

log = logging.getLogger(__name__)

FIGURES_SECONDS = 0.5  # how often every client gets the pool's figures (and the ticks since the last time)
MAX_SAMPLES = 1000  # ticks kept between two figures messages (12.5 a second are due)
STATE_POLL_SECONDS = 0.5  # a waiting call's queue position is re-read this often
RELAY_FAILED = EndReason.error("engine relay failed")


class _Client:
    """One client process's connection and its calls (by the client's rid)."""

    def __init__(self, server: PoolServer, conn: Connection, number: int) -> None:
        self.server = server
        self.name = f"{server.name}/client-{number}"
        self.calls: dict[int, Call] = {}
        self.lock = threading.Lock()
        self.channel = Channel(conn, self.name, self.on_batch, self.on_close)
        self.send: Callable[[msg.ServerMessage], None] = self.channel.send

    def on_batch(self, batch: list[msg.ClientMessage]) -> None:
        """On the channel's reader thread."""
        for message in batch:
            match message:
                case msg.Push(rid=rid, samples=samples):
                    if (call := self.calls.get(rid)) is not None:
                        self.push(call, samples, getattr(message, "held", 0.0))  # a client of an earlier version
                case msg.Release(rid=rid, reason=reason):
                    if (call := self.calls.get(rid)) is not None:
                        call.release(reason)
                case msg.Start():
                    self.start(message)
                case msg.MediaLag(seconds=seconds):
                    self.server.pool.report_media_lag(seconds, self.name)
                case _:
                    log.warning("%s: unexpected %s ignored", self.name, type(message).__name__)

    def push(self, call: Call, samples: np.ndarray, held: float) -> None:
        try:
            call.push_audio(samples, held)
        except CallerError as exc:
            log.warning("%s: call %s sent bad audio (%s); ending it", self.name, call.id, exc)
            call.release(EndReason.error(exc))

    def start(self, start: msg.Start) -> None:
        rid = start.rid
        try:
            call = self.server.pool.admit(start.voice, start.persona, SamplingParams(**start.sampling),
                                          queue=start.may_queue, door=start.door)
        except TypeError as exc:  # not a SamplingParams dict: a client of another version
            self.send(msg.Refused(rid, "caller", f"bad sampling settings: {exc}"))
            return
        except (CallerError, PoolFullError, PoolClosedError) as exc:
            self.send(refused(rid, exc))
            return
        with self.lock:
            self.calls[rid] = call
        # What the client is told now is what the pump compares with: a call that goes live before
        # the pump's first look (a cached prompt prefills within a millisecond) is still reported.
        told = (call.state, call.queue_position, call.slot, call.wait_reason)
        self.send(msg.Started(rid=rid, call_id=call.id, state=told[0].value, queue_position=told[1], slot=told[2],
                              time_left=call.time_left(), wait_reason=told[3]))
        if self.channel.closed:  # gone while we were placing it
            call.release(WORKER_LOST)
            return
        asyncio.run_coroutine_threadsafe(self.pump(rid, call, told), self.server.loop)

    async def pump(self, rid: int, call: Call, sent: tuple) -> None:
        """Send the call's state changes (since `sent`, what the client was told) and outputs until it ends."""
        try:
            while True:
                if call.state.waiting:
                    with contextlib.suppress(TimeoutError):
                        await call.wait_live(timeout=STATE_POLL_SECONDS)
                else:
                    out = await call.next_output(timeout=1.0)
                    if out is not None:
                        # The plan as seconds from now: the client's clock may be another machine's.
                        next_in = None if out.next_take is None else out.next_take - time.monotonic()
                        self.send(msg.Out(rid, out.pcm, out.text, out.tick, out.latency, out.input_drops, next_in))
                now = (call.state, call.queue_position, call.slot, call.wait_reason)
                if now != sent and call.state != CallState.ENDED:
                    sent = now
                    self.send(msg.StateChange(rid=rid, state=call.state.value, queue_position=call.queue_position,
                                              slot=call.slot, time_left=call.time_left(), wait_reason=call.wait_reason))
        except CallEnded as ended:
            end_reason = str(ended.reason)  # a plain string on the wire: the receiver needs no class of ours
        except Exception:
            log.exception("%s: relaying call %s failed; ending it", self.name, call.id)
            call.release(RELAY_FAILED)
            end_reason = RELAY_FAILED
        finally:
            with self.lock:
                self.calls.pop(rid, None)
        self.send(msg.StateChange(rid=rid, state=CallState.ENDED.value, queue_position=None, slot=call.slot,
                                  time_left=None, end_reason=end_reason))

    def on_close(self) -> None:
        with self.lock:
            calls = list(self.calls.values())
        self.server.forget(self)
        live = [c for c in calls if c.state != CallState.ENDED]
        if live and not self.server.closing:
            log.warning("%s disconnected: ending its %d call(s) and freeing their slots", self.name, len(live))
        for call in live:
            call.release(WORKER_LOST)


class PoolServer:
    """One SlotPool for the `EngineLink`s of other processes: one `_Client` per connection."""

    def __init__(self, pool: SlotPool, address: Address, authkey: bytes, name: str = "engine",
                 facts: dict[str, Any] | None = None, figures_seconds: float = FIGURES_SECONDS) -> None:
        self.pool = pool
        self.name = name
        self.facts = dict(facts or {})  # for the Hello (model name, voices, ...)
        self.closing = False
        self._authkey = authkey
        self._listener = listen(address)  # AF_UNIX for a path, TCP for (host, port)
        self.address: Address = address if isinstance(address, str) else self._listener.getsockname()[:2]
        self.figures_seconds = figures_seconds  # the figures double as a heartbeat: `SilenceWatchdog`
        self._clients: list[_Client] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        # Every tick's time and frame latencies, for the clients' own listeners (their /metrics).
        self._samples: list[tuple[float, list[float]]] = []
        pool.add_tick_listener(self._on_tick)
        self.loop = asyncio.new_event_loop()
        self._loop_thread, self._accept_thread = daemon_threads((self._run_loop, f"{name}-relay"),
                                                                (self._accept, f"{name}-accept"))

    def start(self) -> PoolServer:
        self._loop_thread.start()
        self._accept_thread.start()
        log.info("%s: serving its slot pool on %s", self.name, self.address)
        return self

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def forget(self, client: _Client) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    def close(self) -> None:
        """Stop accepting, drop every client (their calls end) and stop the relay loop."""
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(OSError):  # wakes the accept thread: its accept fails
            self._listener.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(5.0)
        self._listener.close()
        if isinstance(self.address, str):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            client.channel.close()
        if self._loop_thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_loop(), self.loop)
            self._loop_thread.join(5.0)

    async def _stop_loop(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    # ---- threads -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self.closing:
                    return
                continue
            # Each handshake in a thread of its own: a peer that stalls in it holds up nobody else.
            threading.Thread(target=self._admit, args=(sock,), name=f"{self.name}-admit", daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            hello = msg.Hello(self.name, self.pool.slots_total, asdict(self.pool.config),
                              self.pool.snapshot().as_dict(), self.facts)
            conn = accept_link(sock, self._authkey, hello)  # the Hello alone, before the channel's batches
        except (OSError, EOFError, AuthenticationError) as exc:  # a stranger without the key, or gone
            if not self.closing:
                log.warning("%s: refused a connection (%s)", self.name, type(exc).__name__)
            return
        with self._lock:
            if self.closing:
                conn.close()
                return
            client = _Client(self, conn, next(self._numbers))
            self._clients.append(client)
        client.channel.start()
        log.info("%s connected", client.name)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._send_figures())
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def _on_tick(self, tick_seconds: float, latencies: list[float]) -> None:
        with self._lock:
            if len(self._samples) < MAX_SAMPLES:  # nobody collects them when no client is connected
                self._samples.append((tick_seconds, latencies))

    async def _send_figures(self) -> None:
        while True:
            await asyncio.sleep(self.figures_seconds)
            with self._lock:
                clients = list(self._clients)
                samples, self._samples = self._samples, []
            if clients:
                figures = msg.PoolFigures(self.pool.snapshot().as_dict(), samples)
                for client in clients:
                    client.send(figures)
