"""Is the agent coming back through the caller's microphone? (docs/serving.md § Speaker echo; cost:
bench/echo.py). The loudness of the audio sent and received correlates highly at one steady delay; the
caller's voice wanders."""

from __future__ import annotations

import collections
import time

import numpy as np

from ..frame import SAMPLE_RATE

RATE = 8000  # the audio kept: enough for the loudness of speech, a third of the samples
DECIMATE = SAMPLE_RATE // RATE
WINDOW_SECONDS = 6.0  # of microphone audio judged at each check
BIN_SECONDS = 0.02  # one loudness value: one Opus frame
MAX_DELAY_SECONDS = 1.0
SLACK_SECONDS = 0.3  # the two streams' clocks, as their chunks arrive, differ by this much at most
CHECK_SECONDS = 1.0
THRESHOLD = 0.7  # correlation of the loudness at the best delay (independent speech: mostly below 0.5)
CHECKS_NEEDED = 3  # in a row and at one delay (within DELAY_AGREEMENT): a coincidence wanders, an echo stays
DELAY_AGREEMENT = 0.06
MIN_RMS = 1e-3  # a microphone quieter than this (-60 dBFS) is silence: nothing to judge
MIN_SPREAD_DB = 3.0  # a microphone whose loudness moves less than this is steady: nothing to judge
WARNING = ("The model can hear itself through your speakers: use headphones or turn the volume down, "
           "or it will answer its own voice.")


def to_8k(pcm: np.ndarray) -> np.ndarray:
    """24 kHz samples (float in [-1, 1], or int16) at 8 kHz: each three averaged (a crude low-pass;
    the check needs the shape of speech, not fidelity)."""
    pcm = np.asarray(pcm)
    x = pcm.astype(np.float32, copy=False).reshape(-1)
    n = x.size // DECIMATE * DECIMATE
    scale = np.float32(1 / (DECIMATE * 32768) if pcm.dtype == np.int16 else 1 / DECIMATE)
    # Strided sums: a reduction over rows of three (np.mean, or sum(axis=1)) costs several times more.
    return sum(x[i:n:DECIMATE] for i in range(DECIMATE)) * scale


class Stream:
    """The last seconds of one direction's audio at 8 kHz, and when its newest sample passed."""

    def __init__(self, seconds: float) -> None:
        self.chunks: collections.deque[np.ndarray] = collections.deque()
        self.samples = 0
        self.limit = int(seconds * RATE)
        self.last_at: float | None = None

    def add(self, pcm: np.ndarray, at: float) -> None:
        chunk = to_8k(pcm)
        self.chunks.append(chunk)
        self.samples += chunk.size
        self.last_at = at
        while self.samples - self.chunks[0].size >= self.limit:
            self.samples -= self.chunks.popleft().size

    def tail(self, n: int) -> np.ndarray:
        return np.concatenate(list(self.chunks))[-n:] if self.chunks else np.zeros(0, np.float32)


class EchoDetector:
    """One call's two streams (`agent.add` for audio sent, `caller.add` for microphone audio received, at
    monotonic seconds) and the verdict. Called from one event loop; not thread-safe."""

    def __init__(self) -> None:
        self.agent = Stream(WINDOW_SECONDS + MAX_DELAY_SECONDS + 2 * SLACK_SECONDS + CHECK_SECONDS)
        self.caller = Stream(WINDOW_SECONDS + CHECK_SECONDS)
        self._checked_at = 0.0
        self._hits = 0
        self.score = 0.0  # the last check's best correlation
        self.delay_seconds: float | None = None
        self.detected_at: float | None = None  # wall time of the first warning (time.time())

    @property
    def detected(self) -> bool:
        return self.detected_at is not None

    def summary(self) -> dict:
        """For the call's transcript JSON."""
        at = self.detected_at
        return {"detected": self.detected,
                "detected_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at)) if at else None,
                "correlation": round(self.score, 2),
                "delay_ms": round(1e3 * self.delay_seconds) if self.delay_seconds is not None else None}

    def check(self, now: float) -> bool:
        """Judge the last seconds, at most once a second; True once the echo has been found."""
        if now - self._checked_at < CHECK_SECONDS:
            return self.detected
        self._checked_at = now
        previous = self.delay_seconds
        self.score, self.delay_seconds = self._best()
        steady = (self._hits == 0 or (previous is not None and self.delay_seconds is not None
                                      and abs(self.delay_seconds - previous) <= DELAY_AGREEMENT))
        self._hits = self._hits + 1 if self.score >= THRESHOLD and steady else int(self.score >= THRESHOLD)
        if self._hits >= CHECKS_NEEDED and self.detected_at is None:
            self.detected_at = time.time()
        return self.detected

    def _best(self) -> tuple[float, float | None]:
        """The highest correlation of the two loudness envelopes over the delays, and its delay."""
        n = int(WINDOW_SECONDS * RATE)
        if self.caller.samples < n or self.caller.last_at is None or self.agent.last_at is None:
            return 0.0, None
        mic = self.caller.tail(n)
        if float(np.sqrt(np.mean(mic * mic))) < MIN_RMS:
            return 0.0, None
        # The agent audio that could have come back in the microphone's window: from MAX_DELAY
        # (plus slack) before the window's start to its end, by the wall clock.
        ahead = max(0.0, self.agent.last_at - self.caller.last_at)  # agent audio newer than the mic's end
        span = n + int((MAX_DELAY_SECONDS + 2 * SLACK_SECONDS) * RATE)
        agent = self.agent.tail(span + int(ahead * RATE))[:span]
        if agent.size < n + RATE // 10:
            return 0.0, None
        x, y = loudness(mic), loudness(agent)
        bins = x.size
        if np.ptp(x) < MIN_SPREAD_DB:  # a steady tone, a hum: nothing that speech would leave
            return 0.0, None
        x = x - x.mean()
        windows = np.lib.stride_tricks.sliding_window_view(y, bins)  # [delays, bins], oldest first
        windows = windows - windows.mean(axis=1, keepdims=True)
        denominators = np.sqrt(np.einsum("ij,ij->i", windows, windows) * float(np.dot(x, x)))
        with np.errstate(invalid="ignore", divide="ignore"):
            scores = np.where(denominators > 0, (windows @ x) / denominators, 0.0)
        lag = int(np.argmax(scores))
        best = float(scores[lag])
        if best <= 0:
            return 0.0, None
        # The microphone's bin i matched the agent's bin lag + i: it came back this much later.
        delay = (y.size - bins - lag) * BIN_SECONDS + max(0.0, self.caller.last_at - self.agent.last_at)
        return best, max(0.0, delay)


def loudness(x: np.ndarray) -> np.ndarray:
    """dB per BIN_SECONDS: a codec keeps each band's energy per frame, if not the waveform of noise."""
    n = int(BIN_SECONDS * RATE)
    frames = x[: x.size // n * n].reshape(-1, n).astype(np.float64)
    return 10 * np.log10(np.mean(frames * frames, axis=1) + 1e-10)
