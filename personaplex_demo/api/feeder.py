"""The client's audio into its call at the room's own pace (docs/realtime.md § Audio in).

The door holds what a client appended (`InputAudio`, bounded) and hands the call at most
`feed_lead_frames` frames beyond the agent frames read back, so audio sent faster than real time
waits here rather than in the room, and a client sending in real time adds no delay. After
`fill_after_seconds` without audio it plays silence, for up to `fill_silence_seconds`, so the
model keeps listening and answering through a client's pause. A muted client's audio is heard
as silence (GPT-Live's `session.input_audio.mute`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..frame import FRAME_SAMPLES
from ..serving.door import DoorCall
from ..serving.room import CallHandle, CallState
from .audio_in import InputAudio, decode_pcm16, pcm16_samples
from .config import ApiConfig

SILENCE = np.zeros(FRAME_SAMPLES, np.int16)


class Feeder:
    def __init__(self, config: ApiConfig, heard: Callable[[np.ndarray], None] | None = None) -> None:
        self.config = config
        self.heard = heard  # called with each frame handed to the room
        self.muted = False
        self.audio = InputAudio(config.input_buffer_seconds)
        self.in_flight = 0  # frames handed to the room and not yet answered by an output
        self.frames_in = 0
        self.dropped_before_live = 0  # samples appended while the call was not live (not heard)
        self.last_audio_at = time.monotonic()

    def append(self, audio: str, call: CallHandle | None, event_id: str | None) -> bool:
        """Hold an appended chunk of base64 PCM16 while `call` is live (RealtimeError when it is
        not PCM16 or past the bound); True if it was held. Before the call is live the model is
        not listening: the chunk is only counted, neither decoded nor held, so that a caller
        waiting in the queue costs the reading of its events and no more."""
        if call is not None and call.state != CallState.LIVE:
            self.dropped_before_live += pcm16_samples(audio)
            return False
        # Before any call, a bad chunk is still refused.
        return self.append_pcm(decode_pcm16(audio, event_id), call, event_id)

    def append_pcm(self, samples: np.ndarray, call: CallHandle | None, event_id: str | None = None) -> bool:
        """Hold int16 samples while `call` is live (RealtimeError past the bound); True if held."""
        if call is None or call.state != CallState.LIVE:
            self.dropped_before_live += samples.size
            return False
        self.audio.append(samples, event_id)
        self.last_audio_at = time.monotonic()
        return True

    def live(self) -> None:
        """The call went live: a pause is counted from now."""
        self.last_audio_at = time.monotonic()

    def answered(self) -> None:
        """One agent frame was read back: the room took one frame (or stepped silence)."""
        self.in_flight = max(0, self.in_flight - 1)

    def feed(self, door_call: DoorCall) -> None:
        """Hand the room what it may take now, through the call's door (`DoorCall.push`), the one
        way every door's audio enters a call."""
        call = door_call.call
        if call is None or call.state != CallState.LIVE:
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
            door_call.push(frame)
            if self.heard is not None:
                self.heard(frame)
            self.in_flight += 1
            self.frames_in += 1
