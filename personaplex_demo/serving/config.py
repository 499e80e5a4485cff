"""The slot pool's settings: one dataclass, filled from `AppConfig` (cli/config.py) in cli/app.py."""

from __future__ import annotations

from dataclasses import dataclass

# A caller queued this long is told to come back later (`--max-wait`); the room that keeps the
# queue (a SlotPool, or the router in front of several engines) ends the call on its own clock.
DEFAULT_MAX_WAIT_SECONDS = 600.0
ADMISSIONS = ("headroom", "slots")


@dataclass(frozen=True)
class PoolConfig:
    tick_seconds: float = 0.08
    # A live call's input (serving/inbox.py): at most this much held, beyond it the OLDEST goes;
    # at a tick, at least `input_margin_seconds` beyond the frame taken, more while the caller's
    # audio arrives late, and a standing excess is cut.
    input_buffer_seconds: float = 2.0
    input_margin_seconds: float = 0.0
    output_queue_frames: int = 50  # per-slot output bound; a slow consumer loses its OLDEST outputs
    idle_release_seconds: float = 2.0  # a LIVE call with no input frame for this long is released ("idle")
    time_limit_seconds: float | None = 300.0  # per-call limit from going live ("time_limit")
    max_queue: int | None = 32  # callers waiting for a slot beyond this are refused (PoolFullError)
    max_wait_seconds: float | None = DEFAULT_MAX_WAIT_SECONDS  # queued longer ends the call ("queue_timeout")
    resync_after_seconds: float = 1.0  # further behind than this, the ticker skips ahead instead of bursting
    catch_up_gap_seconds: float = 0.04  # shortest gap between two steps while catching up after an overrun
    resync_keep_frames: int = 1  # on a resync each caller's backlog is cut to this many newest frames
    idle_sleep_seconds: float = 0.02  # ticker nap when no call holds a slot
    prefill_budget_seconds: float = 0.04  # prefills per gap between steps stop after this (at least one runs)
    cold_prefills_per_gap: int = 1  # prompts computed (not in the prefix cache) per gap; 0: only the budget limits
    summary_log_seconds: float = 30.0  # INFO summary period while calls are live
    # Admission (serving/headroom.py): "headroom" seats a caller only while the measured tick has
    # room for one more row; "slots" takes every free slot, whatever the tick costs.
    admission: str = "headroom"
    # The share of the tick budget that a predicted (not yet measured) size must leave free.
    headroom_margin: float = 0.15
    headroom_prior_rows: int | None = None  # rows taken before a tick time is trusted; None: every slot
    media_lag_limit_seconds: float = 0.05  # no admission while a door's event loop lags more than this
    shed_when_overloaded: bool = True  # end the newest call when the tick stays over budget
    shed_after_seconds: float = 3.0  # ...for this long (and again after each shed)

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, not {self.admission!r}")

    @property
    def by_headroom(self) -> bool:
        return self.admission == "headroom"
