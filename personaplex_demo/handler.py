"""The fastrtc call handler: browser audio in, agent audio and transcript out, one per call.

fastrtc resamples the browser's Opus to 24 kHz and calls `receive` with 40 ms chunks; two of
them make one engine frame. The handler never touches torch and never blocks the event loop:
it only moves numpy arrays to and from its SlotPool `Call`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import numpy as np
from fastrtc import AdditionalOutputs, AsyncStreamHandler, CloseStream

from .engine import SamplingParams
from .errors import CallerError
from .pool import Call, CallEnded, PoolClosedError, PoolFullError, SlotPool
from .recording import CallRecording, RecordingStore
from .voices import DEFAULT_VOICE

log = logging.getLogger(__name__)

FRAME = 1920
SAMPLE_RATE = 24000
N_INPUTS = 7  # voice, persona, text temperature, text top-k, audio temperature, audio top-k, seed
STATUS_EVERY = 6  # ticks between status updates on the page when no text arrives (~0.5 s)

END_MESSAGES = {
    "time_limit": "Time is up for this call. Thanks for talking! Press Record to start a new one.",
    "idle": "The call ended: no microphone audio arrived for a few seconds.",
    "shutdown": "The server is shutting down. Please try again in a minute.",
}


@dataclass(frozen=True)
class CallRequest:
    voice: str
    persona: str
    sampling: SamplingParams

    @classmethod
    def from_args(cls, args: list) -> CallRequest:
        """Read the page's inputs from the END of `latest_args`: its head differs between the
        Gradio page and `Stream.set_input` (fastrtc notes)."""
        vals = list(args[-N_INPUTS:]) if len(args) >= N_INPUTS + 1 else []
        if not vals:
            return cls(DEFAULT_VOICE, "", SamplingParams())
        voice, persona, tt, tk, at, ak, seed = vals
        try:
            sampling = SamplingParams(text_temperature=float(tt), text_top_k=int(tk), audio_temperature=float(at),
                                      audio_top_k=int(ak), seed=None if seed in (None, "", -1) else int(seed))
        except (TypeError, ValueError) as e:
            raise CallerError(f"the sampling settings are not numbers: {e}") from e
        return cls(str(voice or DEFAULT_VOICE), str(persona or ""), sampling)


def status_line(call: Call | None, pool: SlotPool) -> str:
    m = pool.snapshot()
    room = f"slots {m.slots_live + m.slots_prefill}/{m.slots_total} in use"
    if m.queue_length:
        room += f", {m.queue_length} waiting"
    if call is None:
        return f"Connecting… · {room}"
    if call.state == "queued":
        return f"All slots are busy: you are number {call.queue_position} in the queue · {room}"
    if call.state == "prefill":
        return f"Preparing your voice and persona… · {room}"
    if call.state == "live":
        left = call.time_left()
        tail = f" · {int(left // 60)}:{int(left % 60):02d} left" if left is not None else ""
        return f"Live{tail} · {room}"
    return f"Call ended ({call.end_reason}) · {room}"


def stats_line(pool: SlotPool) -> str:
    m = pool.snapshot()
    return (f"room: {m.slots_live + m.slots_prefill}/{m.slots_total} slots in use, {m.queue_length} waiting · "
            f"latency p50 {m.latency_p50_ms:.0f} ms · p99 {m.latency_p99_ms:.0f} ms · tick p50 {m.tick_p50_ms:.0f} ms"
            f" · real-time factor {m.realtime_factor:.2f}")


class CallHandler(AsyncStreamHandler):
    def __init__(self, pool: SlotPool, recordings: RecordingStore | None = None):
        super().__init__(expected_layout="mono", output_sample_rate=SAMPLE_RATE, input_sample_rate=SAMPLE_RATE)
        self.pool = pool
        self.recordings = recordings or RecordingStore()
        self.call: Call | None = None
        self.call_id = uuid.uuid4().hex[:12]
        self.close_message: str | None = None
        self.recording: CallRecording | None = None
        self.transcript = ""
        self._pending = np.zeros(0, np.int16)
        self._ticks = 0
        self._started = asyncio.Event()
        self._bad_input = False
        self.frames_in = 0
        self.frames_out = 0

    def copy(self) -> CallHandler:
        return CallHandler(self.pool, self.recordings)

    async def start_up(self) -> None:
        try:
            await asyncio.wait_for(self.wait_for_args(), 5)
        except TimeoutError:
            log.info("call %s: no page inputs within 5 s, using the defaults", self.call_id)
        try:
            req = CallRequest.from_args(list(self.latest_args or []))
            self.call = self.pool.acquire(req.voice, req.persona, req.sampling)
            self.recording = CallRecording(self.call_id, req.voice, req.persona)
            log.info("call %s: %s, voice %s (%s)", self.call_id, self.call.state, req.voice, self.call.id)
        except (CallerError, PoolFullError, PoolClosedError) as e:
            self.close_message = str(e)
            log.info("call %s refused: %s", self.call_id, e)
        finally:
            self._started.set()

    async def receive(self, frame: tuple[int, np.ndarray]) -> None:
        sr, audio = frame
        if self.call is None or self._bad_input:
            return  # before admission, mic audio is dropped
        audio = np.asarray(audio)
        if sr != SAMPLE_RATE or audio.dtype != np.int16 or audio.ndim > 2:
            # fastrtc resamples to 24 kHz int16; anything else is a client we cannot serve.
            self._bad_input = True
            self.close_message = (f"The audio arrived as {sr} Hz {audio.dtype} {audio.shape}; this server takes "
                                  f"{SAMPLE_RATE} Hz 16-bit mono.")
            log.warning("call %s: %s", self.call_id, self.close_message)
            self.call.release("error: bad audio format")
            return
        if audio.ndim == 2 and min(audio.shape) > 1:  # stereo or more: average the channels
            audio = audio.mean(axis=0 if audio.shape[0] < audio.shape[1] else 1).astype(np.int16)
        self._pending = np.concatenate([self._pending, audio.reshape(-1)])
        while self._pending.size >= FRAME:
            chunk, self._pending = self._pending[:FRAME], self._pending[FRAME:]
            self.call.push_frame(chunk)  # dropped by the pool unless the call is live
            self.frames_in += 1
            if self.recording is not None and self.call.state == "live":
                self.recording.add_caller(chunk.astype(np.float32) / 32768.0)

    async def emit(self):
        if not self._started.is_set():
            await asyncio.sleep(0.05)
            return None
        if self.close_message is not None:
            msg, self.close_message = self.close_message, None
            return CloseStream(msg)
        call = self.call
        if call is None:
            await asyncio.sleep(0.1)
            return None
        try:
            if call.state in ("queued", "prefill"):
                try:
                    await call.wait_live(timeout=0.5)
                except TimeoutError:
                    return self._outputs()
                return self._outputs()
            out = await call.next_output(timeout=0.1)
        except CallEnded as e:
            self._finish()
            if e.reason == "hangup":
                return None
            return CloseStream(END_MESSAGES.get(e.reason, f"The call ended: {e.reason}"))
        if out is None:
            return None
        self.frames_out += 1
        self._ticks += 1
        if self.recording is not None:
            self.recording.add_agent(out.pcm, out.text)
        audio = (SAMPLE_RATE, out.pcm)
        if out.text:
            self.transcript += out.text
        if out.text or self._ticks % STATUS_EVERY == 0:
            return audio, self._outputs()
        return audio

    def _outputs(self) -> AdditionalOutputs:
        return AdditionalOutputs(self.transcript, status_line(self.call, self.pool), stats_line(self.pool),
                                 self.call_id)

    def _finish(self) -> None:
        if self.recording is not None:
            rec, self.recording = self.recording, None
            try:
                self.recordings.save(rec)
            except OSError as e:
                log.warning("call %s: recording not saved: %s", self.call_id, e)

    def shutdown(self) -> None:
        if self.call is not None:
            self.call.release("hangup")
            log.info("call %s: hung up after %d frames in, %d out", self.call_id, self.frames_in, self.frames_out)
        self._finish()

