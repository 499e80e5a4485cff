"""Audio on the wire in 40 ms mono Opus packets, encoded and decoded on the event loop, nothing held on
the way; rtc/patches.py puts the pieces in place. Why: docs/design-notes.md § 40 ms audio packets, § Opus
on the event loop, and docs/design-notes.md § Nothing held on the media path."""

from __future__ import annotations

import asyncio
import fractions
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np
from aiortc import rtcrtpsender, rtp
from aiortc.codecs.opus import OpusEncoder
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError
from aiortc.rtcrtpsender import RTCEncodedFrame
from aiortc.utils import uint16_add
from av import AudioFifo, AudioFrame, AudioResampler, CodecContext
from av.frame import Frame
from fastrtc.tracks import AudioCallback, CloseStream
from fastrtc.utils import AdditionalOutputs, WebRTCError, create_message, current_channel, split_output

log = logging.getLogger(__name__)

PACKET_MS = 40
OPUS_RATE = 48000  # Opus on the wire is always 48 kHz (RTP clock)
OPUS_INPUT_RATES = (8000, 12000, 16000, 24000, 48000)  # what libopus encodes without resampling
# aiortc's receivers drop a packet older than the last one released by more than this many
# (its MAX_MISORDER): beyond it, the sender's numbering restarted.
RESTART_DISTANCE = 100
MAX_FILL_SECONDS = 0.5  # a longer hole in the caller's audio is a paused sender: not filled


def output_frame_samples(sample_rate: int) -> int:
    """fastrtc's output frame length for `sample_rate` audio, matched to one Opus packet."""
    return sample_rate * PACKET_MS // 1000


def with_packet_time(sdp: str, ms: int = PACKET_MS) -> str:
    """`sdp` with `a=ptime:<ms>` at the end of each audio section that has no ptime yet."""
    lines = sdp.split("\r\n")
    out: list[str] = []
    audio = has_ptime = False
    for line in lines:
        if line.startswith("m=") or (line == "" and audio):
            if audio and not has_ptime:
                out.append(f"a=ptime:{ms}")
            audio, has_ptime = line.startswith("m=audio"), False
        has_ptime |= audio and line.startswith("a=ptime:")
        out.append(line)
    if audio and not has_ptime:  # an SDP without the final line break
        out.append(f"a=ptime:{ms}")
    return "\r\n".join(out)


def answering_with_packet_time(handle_offer):
    """Wrap fastrtc's `handle_offer` so that its SDP answers ask for `PACKET_MS` packets."""

    async def handle_offer_with_packet_time(body, set_outputs):
        answer = await handle_offer(body, set_outputs)
        if isinstance(answer, dict) and answer.get("type") == "answer" and "sdp" in answer:
            answer = {**answer, "sdp": with_packet_time(answer["sdp"])}
        return answer

    return handle_offer_with_packet_time


class PacketOpusEncoder(OpusEncoder):
    """aiortc's Opus encoder with `PACKET_MS` mono packets, encoding at the frames' own rate so that
    nothing waits in a resampler; other rates are resampled to 48 kHz, with no fixed frame size."""

    def __init__(self) -> None:
        super().__init__()
        self._fifo: AudioFifo | None = None
        self._packet_samples = 0
        self._rtp_per_sample = fractions.Fraction(1)
        self._packets = 0

    def _open(self, frame) -> None:
        rate = frame.sample_rate if frame.sample_rate in OPUS_INPUT_RATES else OPUS_RATE
        codec = CodecContext.create("libopus", "w")
        # Mono: fastrtc's two channels are copies of one (a third less encoding work than stereo).
        codec.bit_rate, codec.format = self.codec.bit_rate, "s16"
        codec.layout, codec.sample_rate = "mono", rate
        codec.time_base = fractions.Fraction(1, rate)
        codec.options = {"application": "voip", "frame_duration": str(PACKET_MS)}
        self.codec = codec
        self.resampler = AudioResampler(format="s16", layout="mono", rate=rate)  # no change of rate
        self._fifo = AudioFifo()
        self._packet_samples = rate * PACKET_MS // 1000
        self._rtp_per_sample = fractions.Fraction(OPUS_RATE, rate)

    def encode(self, frame, force_keyframe: bool = False) -> tuple[list[bytes], int | None]:
        if self._fifo is None:
            self._open(frame)
        if not self._fifo.samples and frame.samples == self._packet_samples and self.resampler.is_passthrough:
            frame.pts = None  # one packet's audio as it is (AgentFrames cuts them so): no FIFO on the way
            payloads = [bytes(p) for p in self.codec.encode(frame)]
            self._packets += 1
            return payloads, int((self._packets - 1) * self._packet_samples * self._rtp_per_sample)
        for converted in self.resampler.resample(frame):
            converted.pts = None  # the FIFO cuts packets; their RTP times are counted below
            self._fifo.write(converted)
        payloads: list[bytes] = []
        first = self._packets
        while self._fifo.samples >= self._packet_samples:
            payloads += [bytes(p) for p in self.codec.encode(self._fifo.read(self._packet_samples))]
            self._packets += 1
        if not payloads:
            return [], None
        return payloads, int(first * self._packet_samples * self._rtp_per_sample)


async def next_encoded_frame(self, codec):
    """aiortc 1.16's `RTCRtpSender._next_encoded_frame`, step for step, except that an audio frame is
    encoded on the event loop: a 40 ms packet takes libopus less time than the executor's thread hop.
    Video frames still go to the executor."""
    data = await self._RTCRtpSender__track.recv()
    if not self._enabled:  # a disabled sender drops the frame, as aiortc's does
        return None
    audio_level = None
    if self._RTCRtpSender__encoder is None:
        self._RTCRtpSender__encoder = rtcrtpsender.get_encoder(codec)
    encoder = self._RTCRtpSender__encoder
    if isinstance(data, Frame):
        force_keyframe, self._RTCRtpSender__force_keyframe = self._RTCRtpSender__force_keyframe, False
        if isinstance(data, AudioFrame):
            audio_level = rtp.compute_audio_level_dbov(data)
            payloads, timestamp = encoder.encode(data, force_keyframe)
        else:
            payloads, timestamp = await self._RTCRtpSender__loop.run_in_executor(
                None, encoder.encode, data, force_keyframe)
    else:
        payloads, timestamp = encoder.pack(data)
    if not payloads:
        return None
    return RTCEncodedFrame(payloads, timestamp, audio_level)


class LoopDecoding:
    """One audio receiver's packets decoded on the event loop: `install` takes over the receiver's
    queue, whose `put` then decodes each packet in place and hands its frames to the track's queue."""

    def __init__(self, input_q, output_q, decode_error) -> None:
        self.input_q, self.output_q, self.decode_error = input_q, output_q, decode_error
        self.codec_name: str | None = None
        self.decoder = None
        self.stopped = False

    def install(self) -> None:
        """What arrived before this runs, then every later packet, in order."""
        while True:
            try:
                self.put(self.input_q.get_nowait())
            except queue.Empty:
                break
        if not self.stopped:
            self.input_q.put = self.put

    def put(self, task, block: bool = True, timeout: float | None = None) -> None:
        if task is None:  # the receiver stopped: the track ends, and the decoder goes
            self.output_q.put_nowait(None)
            self.decoder, self.stopped = None, True
            vars(self.input_q).pop("put", None)
            return
        codec, encoded_frame = task
        try:
            if codec.name != self.codec_name:
                self.decoder, self.codec_name = _decoder(codec), codec.name
            frames = self.decoder.decode(encoded_frame)
        except Exception as exc:  # as aiortc's thread does with a decoding error: keep the decoder, go on
            log.warning("failed to decode a %s packet: %s", codec.name, exc)
            self.decode_error.set()
            return
        for frame in frames:
            self.output_q.put_nowait(frame)


def _decoder(codec):
    """aiortc's decoder for `codec`; for Opus, one that decodes into mono."""
    from aiortc import rtcrtpreceiver as receiver
    from aiortc.codecs.opus import OpusDecoder

    decoder = receiver.get_decoder(codec)
    if isinstance(decoder, OpusDecoder):
        decoder.codec.layout = "mono"  # before its first packet opens the codec
    return decoder


def make_loop_decoder_worker():
    """In place of aiortc's `decoder_worker` (a thread per receiver, two thread hops per packet, each
    dearer than decoding it): the thread only hands an audio receiver's queue to the loop
    (`LoopDecoding`) and ends. Opus is decoded to mono. Video receivers keep aiortc's thread."""
    from aiortc import rtcrtpreceiver as receiver

    threaded = receiver.decoder_worker

    def decoder_worker(loop, input_q, output_q, decode_error) -> None:
        if not threading.current_thread().name.startswith("audio"):
            threaded(loop, input_q, output_q, decode_error)
            return
        loop.call_soon_threadsafe(LoopDecoding(input_q, output_q, decode_error).install)

    return decoder_worker


def audio_level_dbov(frame) -> int:
    """An audio frame's level in dBov, 0 down to -127 (RFC 6465, Appendix A): aiortc's own
    `aiortc.rtp.compute_audio_level_dbov` to the bit (the int16 sum of squares is exact in both),
    summed by numpy instead of a Python loop."""
    samples = np.frombuffer(frame.planes[0], dtype=np.int16).astype(np.int64)
    energy = float(samples @ samples)
    rms = math.sqrt(energy / (frame.samples * 32767 * 32767))
    return round(min(max(20 * math.log10(rms), -127), 0)) if rms > 0 else -127


class ArrivalJitterBuffer(JitterBuffer):
    """aiortc's jitter buffer for video; for audio, each packet released as it arrives. A packet older
    than one already released is dropped: its place was filled with silence (`InputResampler`)."""

    def __init__(self, capacity: int, prefetch: int = 0, is_video: bool = False) -> None:
        super().__init__(capacity, prefetch, is_video)
        self._last: int | None = None  # sequence number of the last packet released

    def add(self, packet):
        if self._is_video:
            return super().add(packet)
        seq = packet.sequence_number
        # Late or repeated: at most RESTART_DISTANCE behind the last one released (modulo 2**16).
        if self._last is not None and uint16_add(self._last, -seq) < RESTART_DISTANCE:
            return False, None
        self._last = seq
        if not packet._data:
            return False, None
        return False, JitterFrame(data=packet._data, timestamp=packet.timestamp)


class AgentFrames:
    """A call handler's audio as fastrtc's outgoing track takes it: s16 mono `AudioFrame`s of `frame_size`
    samples at `rate`, numbered from 0, cut as soon as enough has come. fastrtc 0.0.34 turns each array into
    planar float and resamples it to stereo (which the Opus encoder then resamples back to mono): two
    filter graphs a packet for what is, at the handler's own rate, a change of sample format."""

    def __init__(self, rate: int, frame_size: int) -> None:
        self.rate, self.frame_size = rate, frame_size
        self._time_base = fractions.Fraction(1, rate)
        self._pending = np.zeros(0, np.int16)
        self._samples = 0  # the next frame's pts

    def cut(self, sample_rate: int, audio: np.ndarray, layout: str = "mono") -> list[AudioFrame]:
        """The frames that `audio` (int16, or float in [-1, 1]; mono, or planar stereo) completes."""
        if sample_rate != self.rate:
            raise WebRTCError(f"the handler emitted {sample_rate} Hz audio; its track sends {self.rate} Hz")
        if layout not in ("mono", "stereo"):
            raise WebRTCError(f"the handler emitted {layout!r} audio; its track takes mono or stereo")
        pcm = np.asarray(audio)
        if layout == "stereo":  # planar, as fastrtc takes it: one row per channel, mixed to the one sent
            if pcm.ndim != 2 or pcm.shape[0] != 2:
                raise WebRTCError(f"the handler emitted stereo audio of shape {pcm.shape}; its track takes (2, samples)")
            scale = np.float32(1 / 32768 if pcm.dtype == np.int16 else 1)
            pcm = pcm.mean(axis=0, dtype=np.float32) * scale
        pcm = pcm.reshape(-1)
        if pcm.dtype != np.int16:  # as libswresample converts float to s16: rounded, clipped
            pcm = np.clip(np.rint(pcm.astype(np.float32, copy=False) * 32768.0), -32768, 32767).astype(np.int16)
        self._pending = np.concatenate((self._pending, pcm)) if self._pending.size else pcm
        frames = []
        while self._pending.size >= self.frame_size:
            chunk, self._pending = self._pending[:self.frame_size], self._pending[self.frame_size:]
            frame = AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self._samples, self._time_base
            self._samples += self.frame_size
            frames.append(frame)
        # What waits for the next array is its own: never a view of an array the handler may reuse.
        self._pending = self._pending.copy() if self._pending.size else np.zeros(0, np.int16)
        return frames


async def agent_audio_worker(next_frame, queue: asyncio.Queue, thread_quit: asyncio.Event, channel,
                             set_additional_outputs, quit_on_none: bool = False, sample_rate: int = OPUS_RATE,
                             frame_size: int = OPUS_RATE // 50) -> None:
    """fastrtc 0.0.34's `player_worker_decode`, step for step, except that the audio is cut by
    `AgentFrames`, and the wait for the handler's next item is a timeout scope, not a task of its own.
    Audio that fastrtc would have resampled (another rate than the track's) ends the track with a logged
    `WebRTCError`: this app's handlers emit at their output rate."""
    frames = AgentFrames(sample_rate, frame_size)
    while not thread_quit.is_set():
        try:
            async with asyncio.timeout(60):
                item = await next_frame()
            audio, outputs = split_output(item)
            if isinstance(outputs, AdditionalOutputs) and set_additional_outputs and channel and channel():
                set_additional_outputs(outputs)
                channel().send(create_message("fetch_output", []))
            if audio is None:
                if isinstance(outputs, CloseStream):
                    await queue.put(outputs)
                if quit_on_none:
                    await queue.put(None)
                    break
                continue
            if not isinstance(audio, tuple) or not isinstance(audio[1], np.ndarray):
                raise WebRTCError("The frame must be a tuple containing a sample rate and a numpy array.")
            for frame in frames.cut(*audio):
                await queue.put(frame)
            if isinstance(outputs, CloseStream):
                await queue.put(outputs)
        except TimeoutError:
            log.warning("no agent audio or update from the handler in 60 s; waiting on")
        except WebRTCError as exc:  # as fastrtc's worker does, said in the log before the track ends
            log.error("the agent's audio stopped: %s", exc)
            raise
        except Exception as exc:  # as fastrtc's worker does: say so, go on with the next item
            log.error("failed to send the handler's output: %s", exc, exc_info=True)


class PacedAudioCallback(AudioCallback):
    """fastrtc's outgoing audio track, paced without an anchor: a packet waits only for the previous
    one's 40 ms, and only while nothing queues behind it."""

    _next_due: float | None = None
    _peeked = None  # a frame that came in while the one before it waited its turn

    async def recv(self):  # the preamble is fastrtc 0.0.34's own
        try:
            if self.readyState != "live":
                raise MediaStreamError
            if not self.event_handler.channel_set.is_set():
                await self.event_handler.channel_set.wait()
            if current_channel.get() != self.event_handler.channel:
                current_channel.set(self.event_handler.channel)
            await self.start()
            frame, self._peeked = (self._peeked if self._peeked is not None else await self.queue.get()), None
            if isinstance(frame, CloseStream):
                self.channel.send(create_message("end_stream", frame.msg))
                self.stop()
                raise MediaStreamError  # the sender stops here, as it did on fastrtc's None
            now = time.monotonic()
            if self._next_due is not None and now < self._next_due and self.queue.empty():
                try:  # wait for its turn, unless more audio comes meanwhile: then it is a backlog
                    async with asyncio.timeout(self._next_due - now):  # no task per packet, as wait_for makes
                        self._peeked = await self.queue.get()
                except TimeoutError:
                    pass
                now = time.monotonic()
            self._next_due = now + frame.samples / frame.sample_rate
            return frame
        except MediaStreamError:
            raise
        except Exception as exc:  # fastrtc logs it and its sender stops; say so, then stop
            log.warning("outgoing audio stopped: %s", exc, exc_info=True)
            raise MediaStreamError from exc


class InputResampler:
    """Decoded frames (any rate and layout) in; s16 mono frames at `rate` out, with no hold. fastrtc's own
    resampler asks PyAV for frames of a fixed size, which libswresample completes only with the next packet
    (40 ms late). A hole in the timestamps (a lost packet) is filled with as much silence as it lasted, so
    the caller's audio keeps its place on the timeline."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = AudioResampler(format="s16", layout="mono", rate=rate)
        self._next_time: fractions.Fraction | None = None  # where the next frame should start (s)
        self.filled_samples = 0  # silence that stood in for lost packets

    def resample(self, frame: AudioFrame) -> Iterator[AudioFrame]:
        gap = self._gap(frame)
        if gap > 0:
            self.filled_samples += gap
            silence = AudioFrame.from_ndarray(np.zeros((1, gap), np.int16), format="s16", layout="mono")
            silence.sample_rate = self.rate
            yield silence
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
