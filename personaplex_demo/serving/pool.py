"""SlotPool: the room (serving/room.py) over one engine shared among many callers. The pool takes
calls, ends them and reports figures; its `Ticker` owns the engine (docs/serving.md § Slot lifecycle).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ..call_settings import SamplingParams
from .call import Call, CallContext
from .config import PoolConfig
from .metrics import PoolCounters, PoolMetrics, PoolWindows, TickListener
from .pacing import Clock, RealClock
from .room import DOOR_PAGE, EndReason, PoolClosedError
from .slot_table import SlotTable
from .ticker import Ticker

if TYPE_CHECKING:
    # Only for annotations: the pool drives any object with the LockstepEngine thread API.
    from ..engine.pcm import LockstepEngine

logger = logging.getLogger(__name__)

_DEFAULT_SAMPLING = SamplingParams()


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
        self._table = SlotTable(int(engine.batch_size), config, self._clock, self._counters, engine.bucket)
        self.closed = False  # after shutdown: no new calls
        self._thread: threading.Thread | None = None
        self._windows = PoolWindows()
        self.ticker = Ticker(engine, self._ctx, self._table, self._windows, self.snapshot)

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
            self._thread = threading.Thread(target=self.ticker.run, name="slot-pool-ticker", daemon=True)
        self._thread.start()
        logger.info("slot pool started: %d slots, tick %.0f ms", self.slots_total, self.config.tick_seconds * 1e3)

    def shutdown(self, join_timeout: float = 10.0) -> None:
        """End every call with reason "shutdown" and join the ticker thread. Idempotent."""
        with self._lock:
            first = not self.closed
            self.closed = True
            for call in self._table.everyone():
                self._table.end(call, EndReason.SHUTDOWN)
        self.ticker.stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)
            if thread.is_alive():
                logger.error("slot pool ticker did not stop within %.0f s (engine call hung?)", join_timeout)
        elif thread is None:
            self.ticker.free_ended_slots()  # never started: this thread is the only engine user
        if first:
            logger.info("slot pool shut down: %s", self.snapshot().summary())

    # ---- admission -----------------------------------------------------------------------------

    async def acquire(self, voice: str, persona: str, sampling: SamplingParams = _DEFAULT_SAMPLING,
                      door: str = DOOR_PAGE) -> Call:
        """The room contract's `acquire` (room.py): `admit`, which never blocks."""
        return self.admit(voice, persona, sampling, door=door)

    def admit(self, voice: str, persona: str, sampling: SamplingParams = _DEFAULT_SAMPLING,
              queue: bool = True, door: str = DOOR_PAGE) -> Call:
        """Take a free slot (PREFILL) or a place in the queue (QUEUED); non-blocking, for any thread.
        Raises as `Room.acquire` does; with `queue=False`, PoolFullError where it would wait."""
        if self.closed:
            raise PoolClosedError("the pool has been shut down; no new calls are taken")
        self.engine.validate_request(voice, persona, sampling)
        call = Call(self._ctx, voice, persona, sampling, door)
        with self._lock:
            if self.closed:
                raise PoolClosedError("the pool has been shut down; no new calls are taken")
            self._table.place(call, queue)  # or PoolFullError
            where = (f"slot {call.slot}" if call.slot is not None
                     else f"queued at position {call.queue_position} ({call.wait_reason})")
        logger.info("call %s (%s): %s, voice %s", call.id, door, where, voice)
        return call

    def report_media_lag(self, seconds: float, source: str = "local") -> None:
        """A door's event loop ran up to `seconds` late lately; admission waits while it lags."""
        with self._lock:
            self._table.policy.record_media_lag(self._clock.monotonic(), source, seconds)

    def _end_call(self, call: Call, reason: str) -> None:
        """`Call.release`: end it under the lock; the ticker frees its slot."""
        with self._lock:
            ended = self._table.end(call, reason)
        if ended:
            logger.info("call %s ended: %s", call.id, reason)

    # ---- figures -------------------------------------------------------------------------------

    def add_tick_listener(self, listener: TickListener) -> None:
        self._windows.listeners.append(listener)

    def snapshot(self) -> PoolMetrics:
        with self._lock:
            seating, counters = self._table.figures(), self._counters.plain()
            sample, ticks = self._windows.sample(), self.ticker.ticks
        return sample.metrics(seating, counters, ticks, self.config.tick_seconds)
