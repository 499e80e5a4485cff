"""What the pool counts: per call, and for the room."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field


@dataclass
class FrameCounters:
    underruns: int = 0  # live ticks with no input frame (after the first): silence stood in
    input_drops: int = 0  # oldest input frames dropped from a full jitter buffer or at a resync
    output_drops: int = 0  # oldest outputs dropped because nobody read them in time


@dataclass
class CallCounters(FrameCounters):
    frames_pushed: int = 0  # pushes of input audio (one per chunk a door handed on)
    frames_out: int = 0


@dataclass
class PoolCounters(FrameCounters):
    """The room's totals; a call's frame counters are added here as they happen."""

    overruns: int = 0  # steps that finished after their deadline
    resyncs: int = 0  # times the ticker fell more than `resync_after_seconds` behind and skipped ahead
    engine_errors: int = 0  # exceptions from engine.step / start_session
    calls_started: int = 0  # calls that went live
    calls_refused: int = 0  # PoolFullError raised
    calls_held_back: int = 0  # calls that waited with a slot free, for lack of headroom in the tick
    calls_ended: collections.Counter[str] = field(default_factory=collections.Counter)  # by `EndReason.kind`
    calls_started_by_door: collections.Counter[str] = field(default_factory=collections.Counter)

    def copy(self) -> PoolCounters:
        return dataclasses.replace(self, calls_ended=collections.Counter(self.calls_ended),
                                   calls_started_by_door=collections.Counter(self.calls_started_by_door))

