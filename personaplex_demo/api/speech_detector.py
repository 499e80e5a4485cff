"""When the caller speaks (docs/realtime.md § Speech events): silero-vad on the audio the model hears,
in one worker thread for every socket, never in the engine's tick nor on the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..frame import SAMPLE_RATE

log = logging.getLogger(__name__)

VAD_RATE = 16000  # silero-vad's rates are 8 and 16 kHz; it reads 512-sample windows at 16 kHz
WINDOW = 512
MAX_BACKLOG_FRAMES = 50  # 4 s: a worker that far behind skips the backlog rather than report it late


@dataclass(frozen=True)
class SpeechConfig:
    """OpenAI's server-VAD defaults, which the frameworks are tuned to."""

    enabled: bool = True
    threshold: float = 0.5  # silero's speech probability
    silence_ms: int = 500  # quiet this long ends the speech
    padding_ms: int = 300  # a start is reported this much before the first speech window


SpeechEvent = tuple[str, int]  # ("started" | "stopped", the time in ms on the call's heard audio)


class SpeechDetector:
    """One call's detector: 24 kHz int16 frames in, speech starts and stops out. Runs in the
    worker thread only (it holds torch state)."""

    def __init__(self, config: SpeechConfig) -> None:
        self.config = config
        self._iterator = None
        self._resampler = None
        self._samples = np.zeros(0, np.float32)  # 16 kHz samples not yet in a window
        self._speaking = False

    def _load(self) -> None:
        from av import AudioResampler
        from silero_vad import VADIterator, load_silero_vad

        with warnings.catch_warnings():  # silero-vad's TorchScript file: torch 2.13 warns on every jit.load
            warnings.simplefilter("ignore", DeprecationWarning)
            model = load_silero_vad()
        self._iterator = VADIterator(model, threshold=self.config.threshold, sampling_rate=VAD_RATE,
                                     min_silence_duration_ms=self.config.silence_ms,
                                     speech_pad_ms=self.config.padding_ms)
        self._resampler = AudioResampler(format="s16", layout="mono", rate=VAD_RATE)

    def hear(self, frames: list[np.ndarray]) -> list[SpeechEvent]:
        import torch
        from av import AudioFrame

        if self._iterator is None:
            self._load()
        pieces = [self._samples]
        for pcm in frames:
            frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = SAMPLE_RATE
            pieces += [out.to_ndarray().reshape(-1).astype(np.float32) / 32768.0
                       for out in self._resampler.resample(frame)]
        samples = np.concatenate(pieces)
        events: list[SpeechEvent] = []
        whole = samples.size // WINDOW * WINDOW
        with torch.no_grad():
            for start in range(0, whole, WINDOW):
                found = self._iterator(torch.from_numpy(samples[start:start + WINDOW]))
                if found and "start" in found and not self._speaking:
                    self._speaking = True
                    events.append(("started", int(found["start"]) * 1000 // VAD_RATE))
                elif found and "end" in found and self._speaking:
                    self._speaking = False
                    events.append(("stopped", int(found["end"]) * 1000 // VAD_RATE))
        self._samples = samples[whole:]
        return events


@functools.cache  # called on the event loop only
def worker() -> ThreadPoolExecutor:
    """The process's one detector thread, started with the first socket that needs it."""
    return ThreadPoolExecutor(1, thread_name_prefix="speech-detector")


class SpeechEvents:
    """One socket's detector, driven from the event loop: `hear` each frame the model hears,
    and `emit(kind, ms)` is called on the loop for each start and stop, in order."""

    def __init__(self, config: SpeechConfig, emit: Callable[[str, int], None]) -> None:
        self._emit = emit
        self._detector = SpeechDetector(config)
        self._pending: list[np.ndarray] = []
        self._busy = False
        self._closed = not config.enabled
        self.skipped_frames = 0

    def hear(self, pcm: np.ndarray) -> None:
        if self._closed:
            return
        self._pending.append(pcm)
        if len(self._pending) > MAX_BACKLOG_FRAMES:
            self.skipped_frames += len(self._pending)
            log.warning("speech detector %d frames behind: skipping them", len(self._pending))
            self._pending = []
            return
        if not self._busy:
            self._submit()

    def close(self) -> None:
        self._closed = True
        self._pending = []

    def _submit(self) -> None:
        frames, self._pending = self._pending, []
        self._busy = True
        loop = asyncio.get_running_loop()
        future = worker().submit(self._detector.hear, frames)

        def back(done: Future) -> None:
            if not loop.is_closed():  # a socket whose server has stopped hears nothing more
                loop.call_soon_threadsafe(self._done, done)

        future.add_done_callback(back)

    def _done(self, future: Future) -> None:
        self._busy = False
        if self._closed:
            return
        if (exc := future.exception()) is not None:
            log.error("the speech detector failed (%s: %s); this socket gets no speech events",
                      type(exc).__name__, exc)
            self.close()
            return
        for kind, ms in future.result():
            self._emit(kind, ms)
        if self._pending:
            self._submit()
