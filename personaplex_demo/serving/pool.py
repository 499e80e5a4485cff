"""SlotPool: the real-time ticker that shares one engine among many callers.

One ticker thread owns the `LockstepEngine`. Every 80 ms it takes one input frame per LIVE slot,
runs one batched `engine.step`, and hands (agent audio, text piece) to each call. Between steps
it ends expired calls, sheds the newest one if the tick has stayed over budget, recycles freed
slots, seats the head of the queue while the measured tick has room for one more row
(serving/headroom.py) and runs prefill (`engine.start_session`). Doors only see the calls as
`CallHandle`s (serving/room.py): numpy arrays in and out, non-blocking pushes and awaitable
outputs; nothing from torch crosses this boundary.

Slot lifecycle (docs/serving.md § Slot lifecycle): IDLE -> PREFILL -> LIVE -> IDLE. A call that
ends (hang-up, idle, time limit, engine error, shutdown) keeps its slot until the ticker has
called `end_session` on it, so a slot is never handed to the next caller while the engine still
holds the old session.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from ..sampling_params import SamplingParams
from .admission import Admission
from .call import Call, CallContext
from .clock import Clock, RealClock
from .config import PoolConfig
from .counters import PoolCounters
from .metrics import PoolMetrics, PoolWindows, TickListener
from .pacing import TickPacer
from .prefill import gap_prefills
from .room import DOOR_PAGE, CallState, EndReason, PoolClosedError, SlotOutput
from .slot_table import SlotTable

if TYPE_CHECKING:
    # Only for annotations: the pool drives any object with the LockstepEngine thread API.
    from ..engine.pcm import LockstepEngine

__all__ = ["SlotPool"]

logger = logging.getLogger(__name__)

_DEFAULT_SAMPLING = SamplingParams()


def _checked_step(engine: LockstepEngine, pcm: np.ndarray) -> tuple[np.ndarray, list[str]]:
    out = engine.step(pcm)
    out_pcm = np.asarray(out.pcm, dtype=np.float32)  # also turns a stray CPU tensor into numpy
    if out_pcm.shape != pcm.shape or len(out.text) != len(pcm):
        raise RuntimeError(f"engine.step returned pcm {out_pcm.shape} and {len(out.text)} texts, "
                           f"expected pcm {pcm.shape} and {len(pcm)} texts")
    return out_pcm, [str(t) for t in out.text]


class SlotPool:
    """Shares one `LockstepEngine` among callers; see the module docstring."""

    def __init__(self, engine: LockstepEngine, config: PoolConfig | None = None, clock: Clock | None = None) -> None:
        self.engine = engine
        self.config = config = config if config is not None else PoolConfig()
        self.frame_size = int(engine.frame_size)
        self._clock: Clock = clock if clock is not None else RealClock()
        self._lock = threading.Lock()
        self._counters = PoolCounters()
        self._ctx = CallContext(self._lock, self._clock, config, self._counters, self.frame_size, self._end_call)
        n = int(engine.batch_size)
        self._table = SlotTable(n)
        # From start_session's attempt until end_session; only the ticker thread uses it.
        self._engine_active = [False] * n
        self.closed = False  # after shutdown: no new calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = 0
        self._windows = PoolWindows()
        self._admission = Admission(config, self._clock, self._table, self._counters, engine.bucket)
        self._pacer = TickPacer(self._clock, config.tick_seconds, config.catch_up_gap_seconds,
                                config.resync_after_seconds, config.idle_sleep_seconds)
        self._last_summary = self._clock.monotonic()

    @property
    def slots_total(self) -> int:
        return len(self._table)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ticker thread that owns the engine. Idempotent."""
        with self._lock:
            if self.closed:
                raise PoolClosedError("the pool has been shut down; create a new SlotPool")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self.run, name="slot-pool-ticker", daemon=True)
        self._thread.start()
        logger.info("slot pool started: %d slots, tick %.0f ms", self.slots_total, self.config.tick_seconds * 1e3)

    def shutdown(self, join_timeout: float = 10.0) -> None:
        """End every call with reason "shutdown" and join the ticker thread. Idempotent."""
        with self._lock:
            first = not self.closed
            self.closed = True
            for call in self._table.everyone():
                self._table.end(call, EndReason.SHUTDOWN)
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)
            if thread.is_alive():
                logger.error("slot pool ticker did not stop within %.0f s (engine call hung?)", join_timeout)
        elif thread is None:
            self._free_ended_slots()  # never started: this thread is the only engine user
        if first:
            logger.info("slot pool shut down: %s", self.snapshot().summary())

    # ---- admission -----------------------------------------------------------------------------

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = _DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE) -> Call:
        """The room contract's `acquire` (room.py): `admit`, which never blocks."""
        return self.admit(voice, persona, sampling, door=door)

    def admit(self, voice: str, persona: str, sampling: SamplingParams = _DEFAULT_SAMPLING,
              queue: bool = True, door: str = DOOR_PAGE) -> Call:
        """Take a free slot (state PREFILL) or a place in the queue (state QUEUED).

        Non-blocking, for any thread. Raises a CallerError for a bad request, PoolFullError when the
        queue is full (with `queue=False`: when it would wait), PoolClosedError after shutdown."""
        if self.closed:
            raise PoolClosedError("the pool has been shut down; no new calls are taken")
        self.engine.validate_request(voice, persona, sampling)
        call = Call(self._ctx, voice, persona, sampling, door)
        with self._lock:
            if self.closed:
                raise PoolClosedError("the pool has been shut down; no new calls are taken")
            self._admission.place(call, queue)  # or PoolFullError
            where = (f"slot {call.slot}" if call.slot is not None
                     else f"queued at position {call.queue_position} ({call.wait_reason})")
        logger.info("call %s (%s): %s, voice %s", call.id, door, where, voice)
        return call

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        """A door's event loop ran up to `seconds` late lately; admission waits while it lags."""
        with self._lock:
            self._admission.record_media_lag(source, seconds)

    def _end_call(self, call: Call, reason: str) -> None:
        """`Call.release`: end it under the lock; the ticker frees its slot."""
        with self._lock:
            ended = self._table.end(call, reason)
        if ended:
            logger.info("call %s ended: %s", call.id, reason)

    # ---- the ticker ----------------------------------------------------------------------------

    def run(self) -> None:
        """The ticker loop (serving/pacing.py): the thread's target."""
        try:
            while not self._stop.is_set():
                self.iterate()
        finally:
            self._free_ended_slots()  # shutdown ended every call; give their slots back to the engine

    def iterate(self) -> None:
        """One turn of the ticker: a nap while the room is empty, else a wait for the deadline and a tick."""
        try:
            with self._lock:
                busy = self._table.busy
            if not busy:
                self._pacer.stop()
                self._clock.sleep(self.config.idle_sleep_seconds)
                return
            self._pacer.wait()
            late = self._pacer.stepped(self.tick_once())
            with self._lock:
                self._counters.overruns += late.seconds > 0
            if late.resync:
                self._resync(late.seconds)
            self._maybe_log_summary()
        except Exception:
            # A bug here must not silently stop every call; log it and keep serving.
            logger.exception("slot pool ticker iteration failed")
            self._clock.sleep(self.config.idle_sleep_seconds)

    def _resync(self, late: float) -> None:
        with self._lock:
            self._counters.resyncs += 1
            dropped = self._table.trim_backlogs(self.config.resync_keep_frames)
        logger.warning("slot pool ticker %.2f s behind; resynchronised, dropped %d queued input frames",
                       late, dropped)

    def tick_once(self) -> int:
        """One tick: step every LIVE slot, then expire, shed, recycle, admit, prefill; the slots stepped."""
        stepped = self._step_live()
        self._expire()
        self._free_ended_slots()
        self._run_prefills()
        return stepped

    def _step_live(self) -> int:
        clock = self._clock
        start = clock.monotonic()
        pcm = np.zeros((self.slots_total, self.frame_size), dtype=np.float32)
        with self._lock:
            rows, ages = self._table.take_frames(pcm, start)
        self._pacer.follow(ages)
        if not rows:
            return 0
        step_start = clock.monotonic()
        try:
            out_pcm, texts = _checked_step(self.engine, pcm)
        except Exception as exc:  # noqa: BLE001 -- any engine failure ends these calls, not the pool
            self._engine_failed([call for _, call, _ in rows], exc, "engine.step")
            return len(rows)
        step_seconds = clock.monotonic() - step_start
        latencies: list[float] = []  # of the frames stepped this tick
        with self._lock:
            self._tick += 1
            now = clock.monotonic()
            for slot, call, stamp in rows:
                lag = None if stamp is None else now - stamp  # None: silence stood in for the input
                if call.deliver(SlotOutput(out_pcm[slot].copy(), texts[slot], self._tick, lag)) and lag is not None:
                    latencies.append(lag)
            self._windows.add_tick(now - start, latencies, step_seconds)
            self._admission.record_tick(now, len(rows), now - start)
        self._windows.notify(now - start, latencies)
        return len(rows)

    def add_tick_listener(self, listener: TickListener) -> None:
        """See `PoolWindows.listeners`."""
        self._windows.listeners.append(listener)

    def _engine_failed(self, calls: list[Call], exc: Exception, what: str) -> None:
        """An engine failure ends the calls it touched, not the pool."""
        logger.exception("%s failed; ending call(s) %s", what, ", ".join(c.id for c in calls), exc_info=exc)
        reason = EndReason.error(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._counters.engine_errors += 1
            for call in calls:
                self._table.end(call, reason)

    def _expire(self) -> None:
        """End the calls that `Call.expiry` says must go (queued or live), and the newest one when
        the tick has stayed over budget (`Admission.to_shed`): those who came first keep real time."""
        now = self._clock.monotonic()
        with self._lock:
            ending = [(c, r) for c in self._table.everyone() if (r := c.expiry(now)) is not None]
            if (newest := self._admission.to_shed()) is not None:
                ending.append((newest, EndReason.OVERLOADED))
            for call, reason in ending:
                self._table.end(call, reason)
        for call, reason in ending:
            logger.log(logging.WARNING if reason == EndReason.OVERLOADED else logging.INFO,
                       "call %s ended: %s", call.id, reason)

    def _free_ended_slots(self) -> None:
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
            seated = [] if self.closed else self._admission.seat_waiting()
        for call in seated:
            logger.info("call %s: slot %d (from the queue)", call.id, call.slot)

    def _run_prefills(self) -> None:
        """Prefill waiting slots, one after another (`prefill.gap_prefills` says which and how many)."""
        clock = self._clock
        for slot, call, cold in gap_prefills(self._table, self._lock, self.engine.prefix_cached, clock, self.config):
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
            self._free_ended_slots()  # a release during prefill, or a failure, frees the slot now

    def snapshot(self) -> PoolMetrics:
        with self._lock:
            slots = self._table.counts()
            counters = self._counters.copy()
            sample, ticks = self._windows.sample(), self._tick
            admission = self._admission.figures(slots.free)
        return sample.metrics(slots, counters, ticks, self.config.tick_seconds, admission)

    def _maybe_log_summary(self) -> None:
        if self._clock.monotonic() - self._last_summary >= self.config.summary_log_seconds:
            self._last_summary = self._clock.monotonic()
            if (metrics := self.snapshot()).slots_live:
                logger.info("slot pool: %s", metrics.summary())
