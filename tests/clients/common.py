"""What the framework callers share (each runs in its framework's own virtual environment, so
this imports nothing of the app): the caller's audio from a WAV, real-time pacing, the result
line the test reads."""

from __future__ import annotations

import argparse
import json
import sys
import time
import wave

import numpy as np

RATE = 24000
CHUNK = 480  # 20 ms, what a transport's microphone hands a pipeline


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--protocol", choices=("realtime", "live", "chat"), required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--persona", required=True)
    parser.add_argument("--voice", default="NATF2")
    parser.add_argument("--speech", required=True, help="the caller's audio: a 24 kHz 16-bit mono WAV")
    parser.add_argument("--barge-at", type=float, required=True, help="s into the audio where the caller cuts in")
    parser.add_argument("--tail", type=float, default=2.0, help="s of silence streamed after the audio")
    return parser.parse_args()


def read_speech(path: str, tail: float) -> np.ndarray:
    with wave.open(path) as wav:
        assert wav.getframerate() == RATE and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    return np.concatenate([pcm, np.zeros(int(tail * RATE), np.int16)])


class Clock:
    """Seconds since the caller's audio began, and a real-time schedule for its chunks."""

    def __init__(self) -> None:
        self.t0: float | None = None

    def start(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def wait(self, k: int) -> float:
        """How long until chunk k is due."""
        return max(0.0, self.t0 + k * CHUNK / RATE - time.monotonic())


class AgentAudio:
    """The agent's audio as the client got it: seconds in all, and after the barge-in."""

    def __init__(self, clock: Clock, barge_at: float) -> None:
        self.clock, self.barge_at = clock, barge_at
        self.seconds = 0.0
        self.after_barge_in = 0.0
        self.audible = 0.0

    def add(self, pcm16: bytes) -> None:
        samples = np.frombuffer(pcm16, "<i2")
        seconds = samples.size / RATE
        self.seconds += seconds
        if samples.size and np.sqrt(np.mean(samples.astype(np.float64) ** 2)) > 100:
            self.audible += seconds
        if self.clock.now() > self.barge_at:
            self.after_barge_in += seconds


def report(**fields) -> None:
    """The one line the test reads, last on stdout."""
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()
