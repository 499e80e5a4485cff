"""The client's audio into its call at the room's own pace, and silence through a client's pause
(docs/realtime.md § Audio in): audio sent faster than real time waits here, bounded, not in the room.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..frame import FRAME_SAMPLES
from ..serving.door import DoorCall
from ..serving.room import CallState
from .audio_in import InputAudio, decode_pcm16
from .config import ApiConfig

SILENCE = np.zeros(FRAME_SAMPLES, np.int16)


class Feeder:
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

    def live(self) -> None:
        """The call went live: a pause is counted from now."""
        self.last_audio_at = time.monotonic()

    def answered(self) -> None:
        """One agent frame was read back: the room took one frame (or stepped silence)."""
        self.in_flight = max(0, self.in_flight - 1)

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
