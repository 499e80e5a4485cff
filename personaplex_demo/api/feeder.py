"""The client's audio into its call: base64 PCM16 chunks of any length in, 80 ms frames out at the room's
own pace, and silence through a client's pause (docs/realtime.md § Audio in). Audio sent faster than
real time waits here, bounded, not in the room."""

from __future__ import annotations

import base64
import binascii
import collections
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from ..frame import FRAME_SAMPLES, SAMPLE_RATE
from ..serving.door import DoorCall, DoorEvent, Ended, Frame, Live
from ..serving.room import CallState
from . import errors as e
from .config import ApiConfig
from .errors import RealtimeError

SILENCE = np.zeros(FRAME_SAMPLES, np.int16)


def to_pcm16(pcm: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 16-bit PCM (NaN as silence, past full scale clipped)."""
    return np.clip(np.round(np.nan_to_num(pcm) * 32767.0), -32768, 32767).astype(np.int16)


def decode_pcm16(audio: str, event_id: str | None = None) -> np.ndarray:
    """Base64 little-endian 16-bit mono PCM as int16 samples; RealtimeError when it is not that."""
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RealtimeError(e.INVALID_BASE64, f"\"audio\" is not valid base64: {exc}", param="audio",
                            event_id=event_id) from None
    if len(raw) % 2:
        raise RealtimeError(e.ODD_BYTE_COUNT, f"\"audio\" decodes to {len(raw)} bytes; 16-bit PCM needs an even "
                            "count (two bytes a sample): send whole samples", param="audio", event_id=event_id)
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


class InputAudio:
    """Appended samples, cut into frames; at most `limit_seconds` of them held."""

    def __init__(self, limit_seconds: float) -> None:
        self.limit = int(limit_seconds * SAMPLE_RATE)
        self._frames: collections.deque[np.ndarray] = collections.deque()
        self._partial = np.zeros(0, np.int16)

    @property
    def samples(self) -> int:
        return len(self._frames) * FRAME_SAMPLES + self._partial.size

    def append(self, samples: np.ndarray, event_id: str | None = None) -> None:
        """Hold `samples`, or refuse all of them (RealtimeError) when they would pass the bound."""
        if self.samples + samples.size > self.limit:
            raise RealtimeError(e.INPUT_BUFFER_FULL, f"{self.samples / SAMPLE_RATE:.1f} s of audio are waiting to be "
                                f"heard; this server holds at most {self.limit / SAMPLE_RATE:g} s ahead of real time. "
                                "This chunk was dropped: send audio at the pace it plays", param="audio", event_id=event_id)
        joined = np.concatenate([self._partial, samples])
        whole = joined.size // FRAME_SAMPLES * FRAME_SAMPLES
        self._frames.extend(joined[:whole].reshape(-1, FRAME_SAMPLES))
        self._partial = joined[whole:].copy()

    def pop(self) -> np.ndarray | None:
        """The oldest whole frame, or None."""
        return self._frames.popleft() if self._frames else None

    def clear(self) -> None:
        self._frames.clear()
        self._partial = np.zeros(0, np.int16)


class Feeder:
    """One socket's call driven: the client's audio handed in at the room's pace, the call's events out."""

    def __init__(self, config: ApiConfig, door_call: DoorCall, heard: Callable[[np.ndarray], None]) -> None:
        self.config, self.door_call = config, door_call
        self.heard = heard  # called with each frame handed to the room
        self.muted = False  # heard as silence (GPT-Live's session.input_audio.mute)
        self.audio = InputAudio(config.input_buffer_seconds)
        self.in_flight = 0  # frames handed to the room and not yet answered by an output
        self.frames_in = 0
        self.last_audio_at = time.monotonic()

    def append(self, audio: str, event_id: str | None) -> None:
        """An appended chunk of base64 PCM16 (RealtimeError when it is not PCM16 or past the bound).
        A waiting caller's chunks are not even decoded; before any call, a bad one is still refused."""
        if self.door_call.state not in (None, CallState.LIVE):
            return
        self.append_pcm(decode_pcm16(audio, event_id), event_id)

    def append_pcm(self, samples: np.ndarray, event_id: str | None = None) -> None:
        """int16 samples, held and fed while the call is live (RealtimeError past the bound)."""
        if self.door_call.state != CallState.LIVE:
            return
        self.audio.append(samples, event_id)
        self.last_audio_at = time.monotonic()
        self.feed()

    def feed(self) -> None:
        """Hand the room what it may take now, through the call's door (`DoorCall.push`)."""
        if self.door_call.state != CallState.LIVE:
            return
        while self.in_flight < self.config.feed_lead_frames:
            frame = self.audio.pop()
            if frame is None:
                quiet = time.monotonic() - self.last_audio_at
                filling = self.config.fill_after_seconds <= quiet < self.config.fill_silence_seconds
                if self.in_flight or not filling:
                    return
                frame = SILENCE
            elif self.muted:
                frame = SILENCE
            self.door_call.push(frame)
            self.heard(frame)
            self.in_flight += 1
            self.frames_in += 1

    async def events(self) -> AsyncIterator[DoorEvent | None]:
        """The started call's events until its end: its news until it is live (a frame before the news
        of it counts: the call went live and ended at once), then its frames, each live step followed by
        None once the audio was fed."""
        while not isinstance(ev := await self.door_call.next_event(1.0), (Live, Frame)):
            if ev is not None:
                yield ev
            if isinstance(ev, Ended):
                return
        yield ev if isinstance(ev, Live) else Live(None)
        self.last_audio_at = time.monotonic()  # a pause is counted from the start
        self.feed()
        while True:
            match ev if isinstance(ev, Frame) else await self.door_call.next_event(0.25):
                case Frame() as frame:  # the room took one frame (or stepped silence)
                    self.in_flight = max(0, self.in_flight - 1)
                    yield frame
                case Ended() as end:
                    yield end
                    return
            ev = None
            self.feed()
            yield None
