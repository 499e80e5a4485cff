"""One caller in the slot pool: its state, its frames in and out, and its counters. The caller's loop
and the pool's ticker both hold the pool's lock (`CallContext.lock`), so a state change and its
wake-up happen together; "the pool's side" expects it held. States: docs/serving.md § Slot lifecycle.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..call_settings import SamplingParams
from ..errors import AudioFormatError
from .config import PoolConfig
from .headroom import WaitReason
from .inbox import Inbox, InboxConfig
from .metrics import CallCounters, PoolCounters
from .pacing import Clock
from .room import DOOR_PAGE, CallState, EndReason, SlotOutput
from .waiting import CallView, WaitingCall, queue_expiry


@dataclass(frozen=True)
class CallContext:
    """What every call of one pool shares with it."""

    lock: threading.Lock
    clock: Clock
    config: PoolConfig
    counters: PoolCounters
    frame_size: int
    release: Callable[[Call, str], None]  # the pool's end-of-call: takes the lock, leaves the queue


# One push holds at most this much audio (one second): a door hands audio on as it arrives.
MAX_PUSH_SAMPLES = 24_000
MAX_HELD_SECONDS = 0.5  # a client's `held` beyond this is not believed (a tick's batch is held at most one tick)


def checked_audio(samples: np.ndarray) -> np.ndarray:
    """`samples` as a flat array of 1 to MAX_PUSH_SAMPLES int16 or float samples, or AudioFormatError."""
    arr = np.asarray(samples)
    if arr.ndim > 1 and sorted(arr.shape)[-2] != 1:
        raise AudioFormatError(f"input audio must be mono (one channel), got shape {arr.shape}")
    if not 0 < arr.size <= MAX_PUSH_SAMPLES:
        raise AudioFormatError(f"one push of input audio must hold 1 to {MAX_PUSH_SAMPLES} samples (24 kHz mono), "
                               f"got shape {arr.shape}")
    if arr.dtype != np.int16 and arr.dtype.kind != "f":
        raise AudioFormatError(f"input audio must be int16 or float32 samples, got {arr.dtype}")
    return arr.reshape(arr.size)


class Call(CallView, WaitingCall):
    """One caller; every public method outside "the pool's side" is thread-safe."""

    def __init__(self, ctx: CallContext, voice: str, persona: str, sampling: SamplingParams,
                 door: str = DOOR_PAGE) -> None:
        CallView.__init__(self, uuid.uuid4().hex[:12], door)
        WaitingCall.__init__(self, guard=ctx.lock, outbox_frames=ctx.config.output_queue_frames)
        self.voice = voice
        self.persona = persona
        self.sampling = sampling
        self.counters = CallCounters()
        self._ctx = ctx
        self._inbox = Inbox(InboxConfig(frame=ctx.frame_size, bound_seconds=ctx.config.input_buffer_seconds,
                                        margin_seconds=ctx.config.input_margin_seconds))
        self.queued_at = ctx.clock.monotonic()
        self.live_since: float | None = None
        self._last_input: float | None = None
        self._prefill_started = False
        self.held_back = False  # counted once as waiting for headroom (the pool's lock)

    # ---- the caller's side -------------------------------------------------------------------

    def time_left(self) -> float | None:
        limit = self._ctx.config.time_limit_seconds
        with self._ctx.lock:
            if limit is None or self.state != CallState.LIVE or self.live_since is None:
                return None
            return max(0.0, limit - (self._ctx.clock.monotonic() - self.live_since))

    def push_audio(self, samples: np.ndarray, held: float = 0.0) -> None:
        """`CallHandle.push_audio`: up to `MAX_PUSH_SAMPLES`; the tick cuts frames from it (serving/inbox.py).
        `held`: seconds another process held it before sending it on (procs/tick_gather.py); its age counts
        from its arrival there."""
        arr = checked_audio(samples)  # copied to float32 either way: the sender may reuse its buffer
        audio = arr.astype(np.float32) / 32768.0 if arr.dtype == np.int16 else arr.astype(np.float32, copy=True)
        held = min(max(held, 0.0), MAX_HELD_SECONDS) if math.isfinite(held) else 0.0
        with self._ctx.lock:
            now = self._ctx.clock.monotonic()
            if self.state != CallState.LIVE:
                return
            self._last_input = now
            self.counters.frames_pushed += 1
            # Beyond the bound the oldest audio goes: the conversation is real time.
            if self._inbox.push(audio, now - held):
                self._count_input_drops()

    def release(self, reason: str = EndReason.HANGUP) -> None:
        self._ctx.release(self, reason)

    # ---- the pool's side: the caller holds the context's lock --------------------------------

    def assign(self, slot: int) -> None:
        """QUEUED -> PREFILL on `slot`."""
        self.slot, self.state, self.queue_position, self.wait_reason = slot, CallState.PREFILL, None, None
        self._wake()

    def set_queue_position(self, position: int, reason: WaitReason) -> None:
        if (self.queue_position, self.wait_reason) != (position, reason):
            self.queue_position, self.wait_reason = position, reason
            self._wake()  # a waiter looks again (a door shows the new place: serving/door.py)

    @property
    def prefill_waiting(self) -> bool:
        """Seated, and nobody plays its prompt yet."""
        return self.state == CallState.PREFILL and not self._prefill_started

    def claim_prefill(self) -> bool:
        """True once for a call in PREFILL: the ticker that gets True plays its prompt."""
        if not self.prefill_waiting:
            return False
        self._prefill_started = True
        return True

    def go_live(self, now: float) -> bool:
        """PREFILL -> LIVE; False if the call was released while its prompt was playing."""
        if self.state != CallState.PREFILL:
            return False
        self.state = CallState.LIVE
        self.live_since = self._last_input = now
        self._ctx.counters.calls_started += 1
        self._ctx.counters.calls_started_by_door[self.door] += 1
        self._wake()
        return True

    def arrival_age(self, now: float) -> float | None:
        """How long the caller's newest audio has been here, once it has filled a frame (else None)."""
        inbox = self._inbox
        return now - inbox.newest if inbox.filled and inbox.newest is not None else None

    def take_frame(self) -> tuple[float | None, np.ndarray | None]:
        """(arrival of its newest sample, frame) for this tick, or (None, None): silence stands in. A
        short frame (late audio) counts as an underrun once the caller has filled one whole frame."""
        took = self._inbox.take(self._ctx.clock.monotonic())
        self._count_input_drops()  # the inbox may have cut a standing backlog
        if took.short:
            self.counters.underruns += 1
            self._ctx.counters.underruns += 1
        return took.stamp, took.frame

    def deliver(self, out: SlotOutput) -> bool:
        """Queue one output; False (nothing queued) unless live. A full outbox loses its oldest:
        a slow reader loses audio, never the ticker's time."""
        if self.state != CallState.LIVE:
            return False  # released during the step: its output has no reader
        if len(self._outbox) == self._outbox.maxlen:  # the append drops the oldest
            self.counters.output_drops += 1
            self._ctx.counters.output_drops += 1
        out.input_drops = self.counters.input_drops
        self._outbox.append(out)
        self.counters.frames_out += 1
        self._wake()
        return True

    def trim_backlog(self, keep: int) -> int:
        """Drop all but the `keep` newest input frames (a resync); how many frames' worth were dropped."""
        before = self.counters.input_drops
        self._inbox.trim(keep * self._ctx.frame_size)
        self._count_input_drops()
        return self.counters.input_drops - before

    def expiry(self, now: float) -> str | None:
        """The reason a queued or live call must end now (queue wait, time limit, idle), or None."""
        cfg = self._ctx.config
        if self.state == CallState.QUEUED:
            return queue_expiry(cfg, now, self.queued_at)
        if self.state != CallState.LIVE or self.live_since is None:
            return None
        if cfg.time_limit_seconds is not None and now - self.live_since >= cfg.time_limit_seconds:
            return EndReason.TIME_LIMIT
        if self._last_input is not None and now - self._last_input >= cfg.idle_release_seconds:
            return EndReason.IDLE
        return None

    def end(self, reason: str) -> bool:
        """-> ENDED, counted under its reason; False if it had already ended."""
        if self.state == CallState.ENDED:
            return False
        # A plain string from here on: it goes into logs, transcripts and the engine's messages.
        self.state, self.end_reason, self.queue_position, self.wait_reason = CallState.ENDED, str(reason), None, None
        self._ctx.counters.calls_ended[EndReason.kind(reason)] += 1
        self._inbox.clear()
        self._wake()
        return True

    # ---- internals ---------------------------------------------------------------------------

    def _count_input_drops(self) -> None:
        """Count the input the inbox dropped (its bound, a cut backlog, a resync) in whole frames."""
        frames = self._inbox.dropped // self._ctx.frame_size - self.counters.input_drops
        if frames:
            self.counters.input_drops += frames
            self._ctx.counters.input_drops += frames
