"""The caller's decoded audio to 24 kHz mono, as soon as it is decoded, with lost packets filled.

Written for fastrtc 0.0.34 and aiortc 1.16 (rtc/patches.py names the versions). fastrtc's own
resampler asks PyAV for frames of a fixed size, so libswresample completes each only with the next
packet (40 ms late); `InputResampler` keeps PyAV's resampler but takes whatever it gives. A hole in the
timestamps (a lost packet, rtc/audio.py `ArrivalJitterBuffer`) is filled with as much silence as it
lasted, so the caller's audio keeps its place on the timeline; one longer than `MAX_FILL_SECONDS` (a
paused sender) is not. docs/design-notes.md § Nothing held on the media path.
"""

from __future__ import annotations

import fractions
from collections.abc import Iterator

import numpy as np
from av import AudioFrame, AudioResampler

MAX_FILL_SECONDS = 0.5


class InputResampler:
    """Decoded frames (any rate and layout) in; s16 mono frames at `rate` out, with no hold."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = AudioResampler(format="s16", layout="mono", rate=rate)
        self._next_time: fractions.Fraction | None = None  # where the next frame should start (s)
        self.filled_samples = 0  # silence that stood in for lost packets

    def resample(self, frame: AudioFrame) -> Iterator[AudioFrame]:
        gap = self._gap(frame)
        if gap > 0:
            self.filled_samples += gap
            yield silence(gap, self.rate)
        yield from self._resampler.resample(frame)

    def _gap(self, frame: AudioFrame) -> int:
        """Samples at `rate` missing before `frame`, by its timestamp (0 if none or unknown)."""
        if frame.pts is None or frame.time_base is None or not frame.sample_rate:
            return 0
        start = frame.pts * frame.time_base
        expected, self._next_time = self._next_time, start + fractions.Fraction(frame.samples, frame.sample_rate)
        if expected is None or start <= expected:
            return 0
        missing = start - expected
        return round(missing * self.rate) if missing <= MAX_FILL_SECONDS else 0


def silence(samples: int, rate: int) -> AudioFrame:
    frame = AudioFrame.from_ndarray(np.zeros((1, samples), np.int16), format="s16", layout="mono")
    frame.sample_rate = rate
    return frame
