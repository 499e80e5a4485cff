"""A live call's input audio between its door and the tick: samples in, one frame per tick out, with
slack held near a target that follows the caller's jitter and never grows for good (docs/serving.md §
Latency budget). The caller passes `now`: nothing reads a clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from ..frame import FRAME_SAMPLES, SAMPLE_RATE

_QUIET_BLOCK = SAMPLE_RATE // 200  # 5 ms: the grain at which the quietest stretch is looked for


@dataclass(frozen=True)
class InboxConfig:
    frame: int = FRAME_SAMPLES
    bound_seconds: float = 2.0  # beyond it the OLDEST samples are dropped (a stalled room)
    # The least slack aimed for on a clean link. None is needed: the tick's phase follows the packets
    # (serving/pacing.py `PhaseAligner`), and a margin shorter than a packet saves no late packet.
    margin_seconds: float = 0.0
    most_margin_seconds: float = 0.05  # the target never grows past this: the margin and a 40 ms packet and more
    window_seconds: float = 1.0  # slack must stay above the target this long before it is cut
    tolerance_seconds: float = 0.01  # ...and by at least this much
    memory_seconds: float = 3.0  # a shortfall keeps the target up this long

    def samples(self, seconds: float) -> int:
        return int(round(seconds * SAMPLE_RATE))


@dataclass
class Take:
    """What a tick took: `frame` (float32) or None when nothing was held; `stamp`, when its newest
    sample arrived; `short`, samples of silence at its end for late audio (0 before the first whole frame)."""

    frame: np.ndarray | None
    stamp: float | None
    short: int


class Inbox:
    """One call's input samples. Not thread-safe: the pool's lock guards it."""

    def __init__(self, config: InboxConfig | None = None) -> None:
        self.config = config = config if config is not None else InboxConfig()
        self._chunks: collections.deque[tuple[float, np.ndarray]] = collections.deque()  # (arrival, samples)
        self.size = 0  # samples held
        self._bound = config.samples(config.bound_seconds)
        self._margin = config.samples(config.margin_seconds)
        self._most_margin = config.samples(config.most_margin_seconds)
        self._tolerance = config.samples(config.tolerance_seconds)
        self._shortfalls: collections.deque[tuple[float, int]] = collections.deque()  # (when, samples)
        self._window_start: float | None = None
        self._window_min: int | None = None
        self.filled = False  # a whole frame was taken at least once (before it: start-up, no shortfall)
        self.newest: float | None = None  # when the newest audio arrived
        self.dropped = 0  # samples dropped in all: the bound, shrinking, trims

    # ---- the door's side ---------------------------------------------------------------------

    def push(self, samples: np.ndarray, now: float) -> int:
        """Hold `samples` (float32, flat); how many of the oldest were dropped to stay in bound."""
        if samples.size:
            self._chunks.append((now, samples))
            self.size += samples.size
            self.newest = now
        excess = self.size - self._bound
        return self._drop_oldest(excess) if excess > 0 else 0

    # ---- the tick's side ---------------------------------------------------------------------

    def target(self, now: float) -> int:
        """The slack aimed for now: the margin plus the largest recent shortfall."""
        memory = self.config.memory_seconds
        while self._shortfalls and now - self._shortfalls[0][0] > memory:
            self._shortfalls.popleft()
        recent = max((s for _, s in self._shortfalls), default=0)
        return min(self._most_margin, self._margin + recent)

    def take(self, now: float) -> Take:
        """The next frame for the tick at `now`."""
        n = self.config.frame
        if not self.size:
            if self.filled:
                self._note_shortfall(now, n)
            return Take(None, None, n if self.filled else 0)
        if self.size >= n:
            slack = self.size - n
            frame, stamp = self._pop(n)
            self.filled = True
            self._watch(now, slack)
            return Take(frame, stamp, 0)
        short = n - self.size
        if self.filled:
            self._note_shortfall(now, short)
        # Keep the new target's worth, so that the late audio, when it comes, finds a margin.
        keep = min(self.size, self.target(now)) if self.filled else 0
        frame = np.zeros(n, np.float32)
        real, stamp = self._pop(self.size - keep) if self.size > keep else (np.zeros(0, np.float32), None)
        frame[:real.size] = real
        return Take(frame, stamp, n - real.size if self.filled else 0)

    def trim(self, keep: int) -> int:
        """Drop all but the `keep` newest samples (a resync); how many were dropped."""
        return self._drop_oldest(self.size - keep) if self.size > keep else 0

    def clear(self) -> None:
        self._chunks.clear()
        self.size = 0

    # ---- internals ---------------------------------------------------------------------------

    def _note_shortfall(self, now: float, samples: int) -> None:
        self._shortfalls.append((now, samples))
        self._window_start = self._window_min = None  # the slack before it says nothing now

    def _watch(self, now: float, slack: int) -> None:
        """Track the least slack over the window; at its end cut what stayed above the target."""
        if self._window_start is None:
            self._window_start, self._window_min = now, slack
            return
        self._window_min = min(self._window_min, slack)
        if now - self._window_start < self.config.window_seconds:
            return
        excess = self._window_min - self.target(now)
        self._window_start = self._window_min = None
        if excess >= self._tolerance:
            self._drop_quietest(min(excess, self.size))

    def _pop(self, n: int) -> tuple[np.ndarray, float | None]:
        """The oldest `n` held samples, and the arrival of the chunk the last of them came in."""
        parts, stamp, need = [], None, n
        while need:
            arrived, chunk = self._chunks[0]
            if chunk.size <= need:
                self._chunks.popleft()
                parts.append(chunk)
                need -= chunk.size
            else:
                parts.append(chunk[:need])
                self._chunks[0] = (arrived, chunk[need:])
                need = 0
            stamp = arrived
        self.size -= n
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), stamp

    def _drop_oldest(self, n: int) -> int:
        self._pop(n)
        self.dropped += n
        return n

    def _drop_quietest(self, n: int) -> None:
        """Remove the `n` consecutive held samples whose energy is least (silence, if any was held)."""
        stamps = np.concatenate([np.full(c.size, t) for t, c in self._chunks])
        audio = np.concatenate([c for _, c in self._chunks])
        energy = np.concatenate([[0.0], np.cumsum(np.square(audio, dtype=np.float64))])
        starts = np.arange(0, audio.size - n + 1, _QUIET_BLOCK)
        start = int(starts[np.argmin(energy[starts + n] - energy[starts])])
        keep = np.r_[0:start, start + n:audio.size]
        audio, stamps = audio[keep], stamps[keep]
        # Chunks again, one per run of equal arrival times.
        cuts = np.flatnonzero(np.diff(stamps)) + 1
        self._chunks = collections.deque(
            (float(s[0]), a) for a, s in zip(np.split(audio, cuts), np.split(stamps, cuts), strict=True) if a.size)
        self.size = audio.size
        self.dropped += n
