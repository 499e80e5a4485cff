"""The slot pool's ticker: the one thread that calls the engine (docs/serving.md § Pacing). Between
two batched steps it ends and sheds calls, recycles ended slots (`end_session` before a slot is
reused), seats the queue's head and runs prefills (`start_session`), at most one uncached prompt per
gap (docs/engine.md § CUDA graphs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from .call import Call, CallContext
from .metrics import PoolMetrics, PoolWindows, tell_listeners
from .pacing import TickPacer
from .room import CallState, EndReason, SlotOutput
from .slot_table import SlotTable

if TYPE_CHECKING:
    from ..engine.pcm import LockstepEngine

logger = logging.getLogger(__name__)


def _checked_step(engine: LockstepEngine, pcm: np.ndarray) -> tuple[np.ndarray, list[str]]:
    out = engine.step(pcm)
    out_pcm = np.asarray(out.pcm, dtype=np.float32)  # also turns a stray CPU tensor into numpy
    if out_pcm.shape != pcm.shape or len(out.text) != len(pcm):
        raise RuntimeError(f"engine.step returned pcm {out_pcm.shape} and {len(out.text)} texts, "
                           f"expected pcm {pcm.shape} and {len(pcm)} texts")
    return out_pcm, [str(t) for t in out.text]


class Ticker:
    """Steps the pool's live calls and moves calls between states; shares the pool's lock, table,
    counters and windows. `snapshot`: the pool's figures, for the periodic summary log."""

    def __init__(self, engine: LockstepEngine, ctx: CallContext, table: SlotTable, windows: PoolWindows,
                 snapshot: Callable[[], PoolMetrics]) -> None:
        self.engine = engine
        self._ctx = ctx
        self._lock, self._clock, self.config = ctx.lock, ctx.clock, ctx.config
        self._table = table
        self._windows = windows
        self._snapshot = snapshot
        self.pacer = TickPacer(self._clock, self.config.tick_seconds, self.config.catch_up_gap_seconds,
                               self.config.resync_after_seconds, self.config.idle_sleep_seconds)
        self.stop = threading.Event()
        self.ticks = 0  # ticks that stepped somebody (under the lock)
        # From start_session's attempt until end_session; only the ticker thread uses it.
        self._engine_active = [False] * len(table)
        self._last_summary = self._clock.monotonic()

    def run(self) -> None:
        """The ticker thread's target, until `stop` is set."""
        try:
            while not self.stop.is_set():
                self.iterate()
        finally:
            self.free_ended_slots()  # shutdown ended every call; give their slots back to the engine

    def iterate(self) -> None:
        """One turn: a nap while the room is empty, else a wait for the deadline and a tick."""
        try:
            with self._lock:
                busy = self._table.busy
            if not busy:
                self.pacer.stop()
                self._clock.sleep(self.config.idle_sleep_seconds)
                return
            self.pacer.wait()
            late = self.pacer.stepped(self.tick_once())
            with self._lock:
                self._ctx.counters.overruns += late.seconds > 0
            if late.resync:
                self._resync(late.seconds)
            self._maybe_log_summary()
        except Exception:
            # A bug here must not silently stop every call; log it and keep serving.
            logger.exception("slot pool ticker iteration failed")
            self._clock.sleep(self.config.idle_sleep_seconds)

    def _resync(self, late: float) -> None:
        with self._lock:
            self._ctx.counters.resyncs += 1
            dropped = self._table.trim_backlogs(self.config.resync_keep_frames)
        logger.warning("slot pool ticker %.2f s behind; resynchronised, dropped %d queued input frames",
                       late, dropped)

    def tick_once(self) -> int:
        """One tick: step every LIVE slot, then expire, shed, recycle, admit, prefill; the slots stepped."""
        stepped = self._step_live()
        self._expire()
        self.free_ended_slots()
        self._run_prefills()
        return stepped

    def _step_live(self) -> int:
        clock = self._clock
        start = clock.monotonic()
        pcm = np.zeros((len(self._table), self._ctx.frame_size), dtype=np.float32)
        with self._lock:
            rows, ages = self._table.take_frames(pcm, start)
        self.pacer.follow(ages)
        if not rows:
            return 0
        next_take = self.pacer.planned()
        step_start = clock.monotonic()
        try:
            out_pcm, texts = _checked_step(self.engine, pcm)
        except Exception as exc:  # noqa: BLE001 -- any engine failure ends these calls, not the pool
            self._engine_failed([call for _, call, _ in rows], exc, "engine.step")
            return len(rows)
        step_seconds = clock.monotonic() - step_start
        latencies: list[float] = []  # of the frames stepped this tick
        with self._lock:
            self.ticks += 1
            now = clock.monotonic()
            for slot, call, stamp in rows:
                lag = None if stamp is None else now - stamp  # None: silence stood in for the input
                out = SlotOutput(out_pcm[slot].copy(), texts[slot], self.ticks, lag, next_take=next_take)
                if call.deliver(out) and lag is not None:
                    latencies.append(lag)
            self._windows.add_tick(now - start, latencies, step_seconds)
            self._table.policy.record_tick(now, len(rows), now - start)
        tell_listeners(self._windows.listeners, [(now - start, latencies)])
        return len(rows)

    def _engine_failed(self, calls: list[Call], exc: Exception, what: str) -> None:
        """An engine failure ends the calls it touched, not the pool."""
        logger.exception("%s failed; ending call(s) %s", what, ", ".join(c.id for c in calls), exc_info=exc)
        reason = EndReason.error(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._ctx.counters.engine_errors += 1
            for call in calls:
                self._table.end(call, reason)

    def _expire(self) -> None:
        """End the calls that `Call.expiry` says must go, and the newest one when the tick has stayed
        over budget (`SlotTable.to_shed`): those who came first keep real time."""
        now = self._clock.monotonic()
        with self._lock:
            ending = [(c, r) for c in self._table.everyone() if (r := c.expiry(now)) is not None]
            if (newest := self._table.to_shed()) is not None:
                ending.append((newest, EndReason.OVERLOADED))
            for call, reason in ending:
                self._table.end(call, reason)
        for call, reason in ending:
            logger.log(logging.WARNING if reason == EndReason.OVERLOADED else logging.INFO,
                       "call %s ended: %s", call.id, reason)

    def free_ended_slots(self) -> None:
        """end_session for every slot whose call has ended, then seat the queue's head on free slots
        while one more row fits."""
        with self._lock:
            ended = [slot for slot, _ in self._table.seated(CallState.ENDED)]
        for slot in ended:
            if self._engine_active[slot]:
                try:
                    self.engine.end_session(slot)
                except Exception:
                    logger.exception("engine.end_session(%d) failed; the slot is reused anyway", slot)
                self._engine_active[slot] = False
            with self._lock:
                self._table.vacate(slot)
        with self._lock:
            seated = self._table.seat_waiting()  # empty after shutdown: it ended the queue
        for call in seated:
            logger.info("call %s: slot %d (from the queue)", call.id, call.slot)

    def _run_prefills(self) -> None:
        """Prefill waiting slots, one after another (`_gap_prefills` says which and how many)."""
        clock = self._clock
        for slot, call, cold in self._gap_prefills():
            self._engine_active[slot] = True
            began = clock.monotonic()
            try:
                self.engine.start_session(slot, call.voice, call.persona, call.sampling)
            except Exception as exc:
                self._engine_failed([call], exc, f"engine.start_session on slot {slot}")
            else:
                now = clock.monotonic()
                with self._lock:
                    live = call.go_live(now)  # False: released while the prompt was playing
                if live:
                    logger.info("call %s live on slot %d (prefill %.3f s, cold %s)", call.id, slot, now - began, cold)
            self.free_ended_slots()  # a release during prefill, or a failure, frees the slot now

    def _gap_prefills(self) -> Iterator[tuple[int, Call, bool]]:
        """The prefills of one gap between ticks, each claimed as it is due: until the gap's budget is
        spent (the first runs whatever the budget), at most `cold_prefills_per_gap` of them cold, so
        that callers arriving together go live on successive ticks instead of one overrun."""
        budget_end = self._clock.monotonic() + self.config.prefill_budget_seconds
        ran = cold_ran = 0
        limit = self.config.cold_prefills_per_gap
        while not ran or self._clock.monotonic() < budget_end:
            pending = self._next_prefill(not limit or cold_ran < limit)
            if pending is None:
                return
            ran, cold_ran = ran + 1, cold_ran + pending[2]
            yield pending

    def _next_prefill(self, cold_allowed: bool) -> tuple[int, Call, bool] | None:
        """The next slot to prefill, claimed (`Call.claim_prefill`), and whether its prompt must be
        computed (cold); a cold one only where `cold_allowed`. The prefix cache is asked outside the
        lock: it tokenizes the persona."""
        with self._lock:
            waiting = self._table.waiting_prefills()
        for slot, call in waiting:
            try:
                cold = not self.engine.prefix_cached(call.voice, call.persona)
            except Exception:  # start_session will say what is wrong with the request
                cold = True
            if cold and not cold_allowed:
                continue
            with self._lock:
                if call.claim_prefill():
                    return slot, call, cold
        return None

    def _maybe_log_summary(self) -> None:
        if self._clock.monotonic() - self._last_summary >= self.config.summary_log_seconds:
            self._last_summary = self._clock.monotonic()
            if (metrics := self._snapshot()).slots_live:
                logger.info("slot pool: %s", metrics.summary())
