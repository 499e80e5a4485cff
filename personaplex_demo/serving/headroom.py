"""Admission by measured headroom: whether one more call fits in the 80 ms tick, and when to shed one
(docs/serving.md § Admission by headroom). The mean tick time, not a high percentile: the pacer catches
up after a long tick, so callers miss audio only when ticks average over 80 ms. Times are passed in.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable

import numpy as np

from .config import PoolConfig


class WaitReason(enum.StrEnum):
    """Why a caller waits (or is refused): what the page, /api/status and the logs say."""

    SLOTS = "all slots are busy"
    CAPACITY = "the room is at capacity on this machine"  # a slot is free, one more row does not fit


# The measurements' fixed settings; the ones a deployment may change are PoolConfig's.
MEASURED_MARGIN = 0.05  # share of the budget a size measured lately must leave free: below the shedding line
SAMPLES_PER_SIZE = 32  # recent ticks remembered at each batch size (2.5 s of ticks)
MIN_SAMPLES = 8  # ticks at a size before its figure is trusted
MEMORY_SECONDS = 30.0  # a size not ticked at for this long is forgotten (the host changes)
MEDIA_LAG_MEMORY_SECONDS = 3.0  # a door's lag report counts for this long


class HeadroomPolicy:
    """The admission and shedding rules, by `PoolConfig`'s headroom settings (its tick is the budget).
    Not thread-safe: the pool holds its lock around every call."""

    def __init__(self, config: PoolConfig, bucket: Callable[[int], int] | None = None) -> None:
        self.config = config
        self.budget = config.tick_seconds
        # The batch a tick of n calls steps (the engine's buckets); n itself where it steps every call.
        self._bucket = bucket if bucket is not None else (lambda calls: calls)
        self._ticks: dict[int, collections.deque[tuple[float, float]]] = {}  # calls -> (when, seconds)
        self._recent: collections.deque[float] = collections.deque(maxlen=SAMPLES_PER_SIZE)
        self._lags: dict[str, tuple[float, float]] = {}  # door -> (when, lag seconds)
        self._over_since: float | None = None
        self._shed_at: float | None = None  # the recent tick time when the last call was shed

    # ---- measurements ----------------------------------------------------------------------------

    def record_tick(self, now: float, calls: int, seconds: float) -> None:
        """One tick that carried `calls` live calls took `seconds`."""
        self._ticks.setdefault(calls, collections.deque(maxlen=SAMPLES_PER_SIZE)).append((now, seconds))
        self._recent.append(seconds)
        if self.recent() > self.budget:
            if self._over_since is None:
                self._over_since = now
        else:
            self._over_since = None
            # The overload is over only once the ticks since the last shed are enough to trust:
            # right after a shed one short tick is all there is, and it would reset the guard.
            if len(self._recent) >= MIN_SAMPLES:
                self._shed_at = None

    def record_media_lag(self, now: float, source: str, seconds: float) -> None:
        """A door's event loop ran `seconds` late lately (its worst in its last report period)."""
        self._lags[source] = (now, seconds)

    def recent(self) -> float:
        """The mean of the most recent ticks, whatever their size (0 before any)."""
        return float(np.mean(self._recent)) if self._recent else 0.0

    def measured(self, now: float) -> dict[int, float]:
        """The mean tick time at each number of calls with enough recent ticks."""
        return {calls: float(np.mean([s for _, s in ticks])) for calls, ticks in self._ticks.items()
                if len(ticks) >= MIN_SAMPLES and now - ticks[-1][0] <= MEMORY_SECONDS}

    def predict(self, now: float, calls: int, figures: dict[int, float] | None = None) -> float | None:
        """Seconds a tick of `calls` calls is expected to take; None with nothing measured, or more
        than one call beyond the nearest measured number below. One more call costs the rows it adds
        at a slope per row: fitted when the figures span two batch sizes, else the nearest figure
        shared out per row (errs on the safe side). `figures`: `measured(now)`, if already at hand."""
        figures = self.measured(now) if figures is None else figures
        if calls in figures:
            return figures[calls]
        below = [c for c in figures if c < calls]
        if not below or calls - max(below) > 1:
            return None
        base = max(below)
        slope = figures[base] / self._bucket(base)
        if len({self._bucket(c) for c in figures}) >= 2:
            known = sorted(figures)
            fitted = float(np.polyfit([self._bucket(c) for c in known], [figures[c] for c in known], 1)[0])
            slope = max(fitted, 0.0)
        return figures[base] + slope * (self._bucket(calls) - self._bucket(base))

    def media_lag(self, now: float) -> float:
        """The worst lag any door reported lately."""
        recent = (lag for when, lag in self._lags.values() if now - when <= MEDIA_LAG_MEMORY_SECONDS)
        return max(recent, default=0.0)

    # ---- decisions -----------------------------------------------------------------------------

    def admits(self, now: float, rows: int) -> bool:
        """May one more call join the `rows` rows held now (live, or being prepared)?"""
        if rows == 0:
            return True  # nobody to protect: a caller alone gets what the machine can do
        if self.media_lag(now) > self.config.media_lag_limit_seconds:
            return False
        figures = self.measured(now)
        if not figures:  # nothing trusted yet: the memory arithmetic's count
            prior = self.config.headroom_prior_rows
            return prior is None or rows < prior
        if self.recent() > self.budget:
            return False
        # A size ticked at lately, within the budget, is taken again as it was (a call ended, a
        # waiting one takes its place); a size not measured is predicted, and needs the margin.
        known = figures.get(rows + 1)
        if known is not None:
            return self.fits_measured(known)
        predicted = self.predict(now, rows + 1, figures)
        return predicted is not None and predicted <= self.budget * (1.0 - self.config.headroom_margin)

    def fits_measured(self, seconds: float) -> bool:
        """A measured tick time within the budget, with the margin a measured size needs."""
        return seconds <= self.budget * (1.0 - MEASURED_MARGIN)

    def headroom(self, now: float, rows: int) -> float:
        """Seconds of the budget left if one more call joined `rows` (negative: over), for the gauge."""
        recent = self.recent()
        predicted = self.predict(now, rows + 1) if rows else None
        return self.budget - max(recent if predicted is None else predicted, recent)

    def shed_due(self, now: float, live: int) -> bool:
        """True when the ticks have been over budget for `shed_after_seconds` with more than one call
        live and the room one call smaller fits; the clock then restarts. Not again while the last
        shed left the ticks as long as they were (less than 5 % shorter): then the host is the cost."""
        cfg = self.config
        if not (cfg.by_headroom and cfg.shed_when_overloaded) or live <= 1 or self._over_since is None:
            return False
        if now - self._over_since < cfg.shed_after_seconds:
            return False
        smaller = self.measured(now).get(live - 1)  # the room one call smaller, as it ticked lately
        if smaller is None or not self.fits_measured(smaller):
            return False
        recent = self.recent()
        if self._shed_at is not None and recent > 0.95 * self._shed_at:
            return False
        self._over_since, self._shed_at = now, recent
        self._recent.clear()  # judge the smaller batch by its own ticks
        return True
