"""The audio a socket appends: base64 PCM16 chunks of any length in, 80 ms frames out, with a
bound on how far ahead of real time a client may be (docs/realtime.md § Audio in)."""

from __future__ import annotations

import base64
import binascii
import collections

import numpy as np

from ..frame import FRAME_SAMPLES, SAMPLE_RATE
from . import errors as e
from .errors import RealtimeError


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

    def clear(self) -> int:
        """Drop everything held; how many samples that was."""
        dropped = self.samples
        self._frames.clear()
        self._partial = np.zeros(0, np.int16)
        return dropped
