"""SlotPool: the real-time ticker that shares one engine among many callers.

One ticker thread owns the `LockstepEngine`. Every 80 ms it takes one input frame per LIVE slot,
runs one batched `engine.step`, and puts (agent audio, text piece) on each call's output queue.
Between steps it ends expired calls, recycles freed slots, admits the head of the queue and runs
prefill (`engine.start_session`). Handlers only see `Call` objects: numpy arrays in and out,
non-blocking pushes and awaitable outputs; nothing from torch crosses this boundary.

Slot lifecycle (DESIGN.md §3): IDLE -> PREFILL -> LIVE -> IDLE. A call that ends (hang-up, idle,
time limit, engine error, shutdown) keeps its slot until the ticker has called `end_session` on it,
so a slot is never handed to the next caller while the engine still holds the old session.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from personaplex_demo.clock import Clock, FakeClock, RealClock
from personaplex_demo.errors import AudioFormatError, CallerError
from personaplex_demo.sampling_params import SamplingParams

if TYPE_CHECKING:
    # Only for annotations: the pool drives any object with the LockstepEngine thread API.
    from personaplex_demo.engine import LockstepEngine

__all__ = [
    "Call",
    "CallEnded",
    "CallerError",
    "Clock",
    "FakeClock",
    "PoolClosedError",
    "PoolConfig",
    "PoolFullError",
    "PoolMetrics",
    "RealClock",
    "SlotOutput",
    "SlotPool",
]

logger = logging.getLogger(__name__)

_DEFAULT_SAMPLING = SamplingParams()

# How many recent ticks / frames the percentiles in `snapshot()` are computed over.
_TICK_WINDOW = 4096
_LATENCY_WINDOW = 8192


@dataclass(frozen=True)
class PoolConfig:
    tick_seconds: float = 0.08
    input_buffer_frames: int = (
        25  # per-slot jitter buffer bound (2 s); beyond it the OLDEST frames are dropped
    )
    output_queue_frames: int = 50  # per-slot output bound; a slow consumer loses its OLDEST outputs
    idle_release_seconds: float = 2.0  # a LIVE call with no input frame for this long is released ("idle")
    time_limit_seconds: float | None = 300.0  # per-call limit from going live ("time_limit")
    max_queue: int | None = 32  # callers waiting for a slot beyond this are refused (PoolFullError)
    resync_after_seconds: float = 1.0  # further behind than this, the ticker skips ahead instead of bursting
    catch_up_gap_seconds: float = 0.04  # shortest gap between two steps while catching up after an overrun
    resync_keep_frames: int = 2  # on a resync each caller's backlog is cut to this many newest frames
    idle_sleep_seconds: float = 0.02  # ticker nap when no call holds a slot
    prefill_budget_seconds: float = 0.04  # prefills per gap between steps stop after this (at least one runs)
    summary_log_seconds: float = 30.0  # INFO summary period while calls are live


class PoolFullError(Exception):
    """Every slot is busy and the waiting queue is full."""


class PoolClosedError(Exception):
    """The pool has been shut down."""


class CallEnded(Exception):
    """The call has ended (and, for `next_output`, every output has been read)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"call ended: {reason}")
        self.reason = reason


@dataclass
class SlotOutput:
    pcm: np.ndarray  # float32 [1920] agent audio at 24 kHz
    text: str  # transcript text that became final this tick ("" if none)
    tick: int


@dataclass
class PoolMetrics:
    slots_total: int
    slots_live: int
    slots_prefill: int
    queue_length: int
    ticks: int
    overruns: int
    tick_p50_ms: float
    tick_p99_ms: float
    realtime_factor: float  # mean tick compute / tick budget
    underruns: int
    input_drops: int
    output_drops: int
    latency_p50_ms: float  # frame pushed -> matching output frame available
    latency_p99_ms: float
    # Additions to the shared contract:
    slots_free: int = 0  # not held by any call; a slot whose call just ended is held until end_session
    added_latency_p50_ms: float = 0.0  # the same latency minus the engine.step time of its tick
    added_latency_p99_ms: float = 0.0
    resyncs: int = 0  # times the ticker fell more than `resync_after_seconds` behind and skipped ahead
    engine_errors: int = 0  # exceptions from engine.step / start_session
    calls_started: int = 0  # calls that went live
    calls_refused: int = 0  # PoolFullError raised
    # Calls ended, by reason: hangup, idle, time_limit, queue_timeout, shutdown, error (any "error: ...").
    calls_ended: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (
            f"live {self.slots_live}/{self.slots_total} prefill {self.slots_prefill} "
            f"queue {self.queue_length} | "
            f"ticks {self.ticks} p50 {self.tick_p50_ms:.1f} ms p99 {self.tick_p99_ms:.1f} ms "
            f"rtf {self.realtime_factor:.2f} overruns {self.overruns} resyncs {self.resyncs} | "
            f"latency p50 {self.latency_p50_ms:.1f} ms p99 {self.latency_p99_ms:.1f} ms "
            f"(added p50 {self.added_latency_p50_ms:.1f} p99 {self.added_latency_p99_ms:.1f}) | "
            f"underruns {self.underruns} input drops {self.input_drops} output drops {self.output_drops} "
            f"engine errors {self.engine_errors}"
        )


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Call:
    """One caller. Created by `SlotPool.acquire`; every method is thread-safe.

    State is guarded by the pool's lock, so a state change and the wake-up of its awaiters happen
    together: an awaiter checks and registers under the same lock and cannot miss a wake-up."""

    def __init__(self, pool: SlotPool, voice: str, persona: str, sampling: SamplingParams) -> None:
        self.id: str = uuid.uuid4().hex[:12]
        self.voice = voice
        self.persona = persona
        self.sampling = sampling
        self.state: str = "queued"  # "queued" | "prefill" | "live" | "ended"
        self.queue_position: int | None = None
        self.slot: int | None = None
        self.end_reason: str | None = None
        # Per-call counters (additions), for logs and the page.
        self.frames_pushed = 0
        self.frames_out = 0
        self.underruns = 0
        self.input_drops = 0
        self.output_drops = 0

        self._pool = pool
        self._lock = pool._lock
        self._inbox: collections.deque[tuple[float, np.ndarray]] = collections.deque()  # (push time, frame)
        self._outbox: collections.deque[SlotOutput] = collections.deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._created_at = pool._clock.monotonic()
        self._live_since: float | None = None
        self._last_input: float | None = None
        self._prefill_started = False

    def __repr__(self) -> str:
        return f"Call({self.id}, {self.state}, slot={self.slot}, queue={self.queue_position})"

    # ---- thread side -------------------------------------------------------------------------

    def time_left(self) -> float | None:
        """Seconds until the time limit; None if there is no limit or the call is not live."""
        limit = self._pool.config.time_limit_seconds
        with self._lock:
            if limit is None or self.state != "live" or self._live_since is None:
                return None
            return max(0.0, limit - (self._pool._clock.monotonic() - self._live_since))

    def push_frame(self, frame: np.ndarray) -> None:
        """Queue one 1920-sample frame (int16 or float, 24 kHz mono). Dropped unless live."""
        samples = self._to_float32(frame)
        pool = self._pool
        with self._lock:
            if self.state != "live":
                return  # audio before the call is live or after it ended has nowhere to go
            now = pool._clock.monotonic()
            self._last_input = now
            self.frames_pushed += 1
            if len(self._inbox) >= pool.config.input_buffer_frames:
                # Keep the newest audio: the conversation is real time, stale frames only add delay.
                self._inbox.popleft()
                self.input_drops += 1
                pool._input_drops += 1
            self._inbox.append((now, samples))

    def release(self, reason: str = "hangup") -> None:
        """End the call. Idempotent; works while queued, in prefill or live. The ticker frees the slot."""
        self._pool._end_call(self, reason)

    def _to_float32(self, frame: np.ndarray) -> np.ndarray:
        size = self._pool.frame_size
        arr = np.asarray(frame)
        if arr.size != size:
            raise AudioFormatError(
                f"an input frame must hold {size} samples (80 ms at 24 kHz mono), got shape {arr.shape}"
            )
        if arr.dtype == np.int16:
            return arr.reshape(size).astype(np.float32) / 32768.0
        if arr.dtype.kind == "f":
            return arr.reshape(size).astype(np.float32, copy=True)  # copy: the sender may reuse its buffer
        raise AudioFormatError(f"an input frame must be int16 or float32 samples, got {arr.dtype}")

    # ---- asyncio side ------------------------------------------------------------------------

    async def wait_live(self, timeout: float | None = None) -> None:
        """Return once live; raise CallEnded if it ended first, TimeoutError after `timeout` s."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._lock:
                if self.state == "live":
                    return
                if self.state == "ended":
                    raise CallEnded(self.end_reason or "ended")
                fut = self._register(loop)
            try:
                await self._await(fut, deadline, loop)
            except TimeoutError:
                with self._lock:
                    if self.state not in ("live", "ended"):
                        raise
            finally:
                self._unregister(fut)

    async def next_output(self, timeout: float) -> SlotOutput | None:
        """The next output frame; None after `timeout` s without one; CallEnded once ended and drained."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self._lock:
                if self._outbox:
                    return self._outbox.popleft()
                if self.state == "ended":
                    raise CallEnded(self.end_reason or "ended")
                if loop.time() >= deadline:
                    return None
                fut = self._register(loop)
            try:
                await self._await(fut, deadline, loop)
            except TimeoutError:
                pass  # one more look: an output may have landed just now
            finally:
                self._unregister(fut)

    def _register(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((loop, fut))
        return fut

    def _unregister(self, fut: asyncio.Future[None]) -> None:
        with self._lock:
            self._waiters = [(lp, f) for lp, f in self._waiters if f is not fut]

    @staticmethod
    async def _await(
        fut: asyncio.Future[None], deadline: float | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        remaining = None if deadline is None else max(0.0, deadline - loop.time())
        await asyncio.wait_for(fut, remaining)

    def _wake_locked(self) -> None:
        """Wake every awaiter; they re-check under the lock. Safe from any thread, including the loop's."""
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass  # that event loop is closed; nobody is waiting any more


class SlotPool:
    """Shares one `LockstepEngine` among callers; see the module docstring."""

    def __init__(
        self, engine: LockstepEngine, config: PoolConfig = PoolConfig(), clock: Clock | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.frame_size = int(getattr(engine, "frame_size", 1920))
        self._clock: Clock = clock if clock is not None else RealClock()
        self._lock = threading.Lock()
        n = int(engine.batch_size)
        self._slots: list[Call | None] = [None] * n
        # True from the moment start_session is attempted until end_session has been called; only
        # the ticker thread reads or writes it.
        self._engine_active = [False] * n
        self._queue: collections.deque[Call] = collections.deque()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = 0
        # Counters and windows (under the lock).
        self._overruns = 0
        self._resyncs = 0
        self._underruns = 0
        self._input_drops = 0
        self._output_drops = 0
        self._engine_errors = 0
        self._calls_started = 0
        self._calls_refused = 0
        self._calls_ended: collections.Counter[str] = collections.Counter()
        self._tick_listeners: list[Callable[[float, list[float]], None]] = []
        self._tick_times: collections.deque[float] = collections.deque(maxlen=_TICK_WINDOW)
        self._latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self._added_latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self._last_summary = self._clock.monotonic()

    @property
    def slots_total(self) -> int:
        return len(self._slots)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ticker thread that owns the engine. Idempotent."""
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool has been shut down; create a new SlotPool")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._thread_main, name="slot-pool-ticker", daemon=True)
        self._thread.start()
        logger.info(
            "slot pool started: %d slots, tick %.0f ms", self.slots_total, self.config.tick_seconds * 1e3
        )

    def shutdown(self, join_timeout: float = 10.0) -> None:
        """End every call with reason "shutdown" and join the ticker thread. Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
            for call in [c for c in self._slots if c is not None] + list(self._queue):
                self._end_locked(call, "shutdown")
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

    def acquire(self, voice: str, persona: str, sampling: SamplingParams = _DEFAULT_SAMPLING,
                queue: bool = True) -> Call:
        """Take a free slot (state "prefill") or a place in the queue (state "queued").

        Non-blocking. Raises a CallerError subclass for a bad request, PoolFullError when the queue
        is full (or, with `queue=False`, when no slot is free: for a caller who may try another
        engine first), PoolClosedError after shutdown."""
        if self._closed:
            raise PoolClosedError("the pool has been shut down; no new calls are taken")
        self.engine.validate_request(voice, persona, sampling)
        call = Call(self, voice, persona, sampling)
        with self._lock:
            if self._closed:
                raise PoolClosedError("the pool has been shut down; no new calls are taken")
            free = self._free_slot_locked()
            # Newcomers never jump the queue, even if a slot is free for an instant.
            if free is not None and not self._queue:
                self._assign_locked(call, free)
            elif not queue:
                raise PoolFullError(f"all {self.slots_total} slots busy")
            elif self.config.max_queue is None or len(self._queue) < self.config.max_queue:
                self._queue.append(call)
                call.queue_position = len(self._queue)
            else:
                self._calls_refused += 1
                raise PoolFullError(
                    f"all {self.slots_total} slots busy and the queue of {self.config.max_queue} is full; "
                    "try again in a minute"
                )
            where = f"slot {call.slot}" if call.slot is not None else f"queued at position {call.queue_position}"
        logger.info("call %s: %s, voice %s", call.id, where, voice)
        return call

    def _free_slot_locked(self) -> int | None:
        for index, occupant in enumerate(self._slots):
            if occupant is None:
                return index
        return None

    def _assign_locked(self, call: Call, slot: int) -> None:
        self._slots[slot] = call
        call.slot = slot
        call.state = "prefill"
        call.queue_position = None
        call._wake_locked()

    def _end_call(self, call: Call, reason: str) -> None:
        with self._lock:
            ended = self._end_locked(call, reason)
        if ended:
            logger.info("call %s ended: %s", call.id, reason)

    def _end_locked(self, call: Call, reason: str) -> bool:
        if call.state == "ended":
            return False
        was_queued = call.state == "queued"
        call.state = "ended"
        call.end_reason = reason
        self._calls_ended[reason.partition(":")[0]] += 1  # "error: <details>" counts as "error"
        call.queue_position = None
        call._inbox.clear()
        if was_queued:
            try:
                self._queue.remove(call)
            except ValueError:
                pass
            self._renumber_queue_locked()
        call._wake_locked()
        return True

    def _renumber_queue_locked(self) -> None:
        for position, waiting in enumerate(self._queue, start=1):
            if waiting.queue_position != position:
                waiting.queue_position = position
                waiting._wake_locked()  # lets a handler that shows the position refresh it

    # ---- the ticker ----------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self.run()
        finally:
            self._free_ended_slots()  # shutdown ended every call; give their slots back to the engine

    def run(self, max_iterations: int | None = None) -> None:
        """The ticker loop: the thread's target. Tests drive it directly with a FakeClock and a bound.

        Deadline pacing: each step is due one tick after the previous deadline. After an overrun the
        ticker catches up with steps `catch_up_gap_seconds` apart (no back-to-back burst), which
        also drains the input that piled up meanwhile. Further behind than `resync_after_seconds`,
        the schedule restarts from now and each backlog is cut, so callers do not stay seconds behind."""
        cfg, clock = self.config, self._clock
        deadline: float | None = None
        last_start: float | None = None
        iterations = 0
        while not self._stop.is_set() and (max_iterations is None or iterations < max_iterations):
            iterations += 1
            try:
                if not self._has_work():
                    deadline = last_start = None
                    clock.sleep(cfg.idle_sleep_seconds)
                    continue
                now = clock.monotonic()
                if deadline is None:
                    deadline = now
                due = deadline if last_start is None else max(deadline, last_start + cfg.catch_up_gap_seconds)
                if now < due:
                    clock.sleep(due - now)
                last_start = clock.monotonic()
                self.tick_once()
                deadline += cfg.tick_seconds
                late = clock.monotonic() - deadline
                if late > 0:
                    with self._lock:
                        self._overruns += 1
                if late > cfg.resync_after_seconds:
                    self._resync(late)
                    deadline = clock.monotonic()
                self._maybe_log_summary()
            except Exception:
                # A bug here must not silently stop every call; log it and keep serving.
                logger.exception("slot pool ticker iteration failed")
                clock.sleep(cfg.idle_sleep_seconds)

    def _resync(self, late: float) -> None:
        keep = self.config.resync_keep_frames
        dropped = 0
        with self._lock:
            self._resyncs += 1
            for call in self._slots:
                while call is not None and len(call._inbox) > keep:
                    call._inbox.popleft()
                    call.input_drops += 1
                    dropped += 1
            self._input_drops += dropped
        logger.warning(
            "slot pool ticker %.2f s behind; resynchronised, dropped %d queued input frames", late, dropped
        )

    def _has_work(self) -> bool:
        with self._lock:
            return any(c is not None for c in self._slots) or bool(self._queue)

    def tick_once(self) -> None:
        """One tick: step every LIVE slot, then (between steps) expire, recycle, admit and prefill."""
        self._step_live()
        self._housekeeping()

    def _step_live(self) -> None:
        clock = self._clock
        start = clock.monotonic()
        rows: list[tuple[int, Call, float | None]] = []  # (slot, call, push time of its frame)
        pcm = np.zeros((self.slots_total, self.frame_size), dtype=np.float32)
        with self._lock:
            for slot, call in enumerate(self._slots):
                if call is None or call.state != "live":
                    continue
                stamp = None
                if call._inbox:
                    stamp, frame = call._inbox.popleft()
                    pcm[slot] = frame
                elif call.frames_pushed:
                    # Silence stands in; before the caller's first frame this is start-up, not an underrun.
                    call.underruns += 1
                    self._underruns += 1
                rows.append((slot, call, stamp))
        if not rows:
            return
        step_start = clock.monotonic()
        try:
            out = self.engine.step(pcm)
            out_pcm = np.asarray(out.pcm, dtype=np.float32)  # also turns a stray CPU tensor into numpy
            if out_pcm.shape != pcm.shape or len(out.text) != self.slots_total:
                raise RuntimeError(
                    f"engine.step returned pcm {out_pcm.shape} and {len(out.text)} texts, "
                    f"expected pcm {pcm.shape} and {self.slots_total} texts"
                )
        except Exception as exc:  # noqa: BLE001 -- any engine failure ends these calls, not the pool
            self._fail_rows([call for _, call, _ in rows], exc)
            return
        step_seconds = clock.monotonic() - step_start
        bound = self.config.output_queue_frames
        latencies: list[float] = []
        with self._lock:
            self._tick += 1
            now = clock.monotonic()
            for slot, call, stamp in rows:
                if call.state != "live":
                    continue  # released during the step: its output has no reader
                if len(call._outbox) >= bound:
                    call._outbox.popleft()  # a slow reader loses the oldest audio, never the ticker's time
                    call.output_drops += 1
                    self._output_drops += 1
                call._outbox.append(SlotOutput(out_pcm[slot].copy(), str(out.text[slot]), self._tick))
                call.frames_out += 1
                if stamp is not None:
                    latencies.append(now - stamp)
                    self._latencies.append(now - stamp)
                    self._added_latencies.append(now - stamp - step_seconds)
                call._wake_locked()
            self._tick_times.append(now - start)
        for listener in self._tick_listeners:
            try:
                listener(now - start, latencies)
            except Exception:
                logger.exception("tick listener failed")

    def add_tick_listener(self, listener: Callable[[float, list[float]], None]) -> None:
        """Call `listener(tick_seconds, frame_latencies_seconds)` after every step, on the ticker
        thread, so it must be quick (a histogram update). Unlike the windows behind `snapshot()`,
        it sees every sample, however long between two readers."""
        self._tick_listeners.append(listener)

    def _fail_rows(self, calls: list[Call], exc: Exception) -> None:
        logger.exception("engine.step failed; ending %d call(s) live in this tick", len(calls), exc_info=exc)
        reason = f"error: {type(exc).__name__}: {exc}"
        with self._lock:
            self._engine_errors += 1
            for call in calls:
                self._end_locked(call, reason)

    def _housekeeping(self) -> None:
        cfg = self.config
        now = self._clock.monotonic()
        expired: list[tuple[Call, str]] = []
        with self._lock:
            for call in self._slots:
                if call is None or call.state != "live" or call._live_since is None:
                    continue
                if cfg.time_limit_seconds is not None and now - call._live_since >= cfg.time_limit_seconds:
                    expired.append((call, "time_limit"))
                elif call._last_input is not None and now - call._last_input >= cfg.idle_release_seconds:
                    expired.append((call, "idle"))
            for call, reason in expired:
                self._end_locked(call, reason)
        for call, reason in expired:
            logger.info("call %s ended: %s", call.id, reason)
        self._free_ended_slots()
        self._run_prefills()

    def _free_ended_slots(self) -> None:
        """end_session for every slot whose call has ended, then hand the slot to the queue's head."""
        with self._lock:
            ended = [slot for slot, c in enumerate(self._slots) if c is not None and c.state == "ended"]
        for slot in ended:
            if self._engine_active[slot]:
                try:
                    self.engine.end_session(slot)
                except Exception:
                    logger.exception("engine.end_session(%d) failed; the slot is reused anyway", slot)
                self._engine_active[slot] = False
            with self._lock:
                self._slots[slot] = None
                if self._queue and not self._closed:
                    self._assign_locked(self._queue.popleft(), slot)
                    self._renumber_queue_locked()

    def _run_prefills(self) -> None:
        """Prefill waiting slots, one after another, until the gap's budget is spent (at least one)."""
        clock = self._clock
        budget_end = clock.monotonic() + self.config.prefill_budget_seconds
        first = True
        while first or clock.monotonic() < budget_end:
            first = False
            with self._lock:
                pending = next(
                    (
                        (s, c)
                        for s, c in enumerate(self._slots)
                        if c is not None and c.state == "prefill" and not c._prefill_started
                    ),
                    None,
                )
                if pending is None:
                    return
                slot, call = pending
                call._prefill_started = True
            self._engine_active[slot] = True
            began = clock.monotonic()
            try:
                self.engine.start_session(slot, call.voice, call.persona, call.sampling)
            except Exception as exc:
                logger.exception("engine.start_session failed for call %s on slot %d", call.id, slot)
                with self._lock:
                    self._engine_errors += 1
                    self._end_locked(call, f"error: {type(exc).__name__}: {exc}")
            else:
                now = clock.monotonic()
                with self._lock:
                    if call.state == "prefill":  # not released while the prompt was playing
                        call.state = "live"
                        call._live_since = now
                        call._last_input = now
                        self._calls_started += 1
                        call._wake_locked()
                        logger.info(
                            "call %s live on slot %d (prefill %.0f ms)", call.id, slot, (now - began) * 1e3
                        )
            self._free_ended_slots()  # a release during prefill, or a failure, frees the slot now

    # ---- metrics -------------------------------------------------------------------------------

    def snapshot(self) -> PoolMetrics:
        with self._lock:
            live = sum(1 for c in self._slots if c is not None and c.state == "live")
            prefill = sum(1 for c in self._slots if c is not None and c.state == "prefill")
            free = sum(1 for c in self._slots if c is None)
            ticks = np.fromiter(self._tick_times, dtype=np.float64)
            lat = np.fromiter(self._latencies, dtype=np.float64)
            added = np.fromiter(self._added_latencies, dtype=np.float64)
            counters = {
                "ticks": self._tick,
                "overruns": self._overruns,
                "resyncs": self._resyncs,
                "underruns": self._underruns,
                "input_drops": self._input_drops,
                "output_drops": self._output_drops,
                "engine_errors": self._engine_errors,
                "calls_started": self._calls_started,
                "calls_refused": self._calls_refused,
                "calls_ended": dict(self._calls_ended),
                "queue_length": len(self._queue),
            }

        def ms(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q) * 1e3) if values.size else 0.0

        return PoolMetrics(
            slots_total=self.slots_total,
            slots_live=live,
            slots_prefill=prefill,
            slots_free=free,
            tick_p50_ms=ms(ticks, 50),
            tick_p99_ms=ms(ticks, 99),
            realtime_factor=float(ticks.mean() / self.config.tick_seconds) if ticks.size else 0.0,
            latency_p50_ms=ms(lat, 50),
            latency_p99_ms=ms(lat, 99),
            added_latency_p50_ms=ms(added, 50),
            added_latency_p99_ms=ms(added, 99),
            **counters,
        )

    def _maybe_log_summary(self) -> None:
        now = self._clock.monotonic()
        if now - self._last_summary < self.config.summary_log_seconds:
            return
        self._last_summary = now
        metrics = self.snapshot()
        if metrics.slots_live:
            logger.info("slot pool: %s", metrics.summary())
