"""Audio on the wire in 40 ms Opus packets instead of WebRTC's usual 20 ms, both ways, in mono,
encoded and decoded on the event loop, with nothing held on the way that need not be: the
answer's `a=ptime:40` (`with_packet_time`), `PacketOpusEncoder` (libopus at the frames' own
rate), `ArrivalJitterBuffer` (each packet released as it arrives), `PacedAudioCallback` (packets
40 ms apart, no anchor that a late first frame sets), `make_inline_encoding` and
`make_loop_decoder_worker` (no thread hop per packet) and `audio_level_dbov` (aiortc's RTP audio
level, by numpy); rtc/patches.py puts them in place. Why each, and what it measured:
docs/design-notes.md § 40 ms audio packets (and the section after it, on Opus on the event
loop), and docs/design-notes.md § Nothing held on the media path.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

PACKET_MS = 40
OPUS_RATE = 48000  # Opus on the wire is always 48 kHz (RTP clock)
OPUS_INPUT_RATES = (8000, 12000, 16000, 24000, 48000)  # what libopus encodes without resampling
# aiortc's receivers drop a packet older than the last one released by more than this many
# (its MAX_MISORDER): beyond it, the sender's numbering restarted.
RESTART_DISTANCE = 100


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


def packet_time(sdp: str) -> int | None:
    """The `a=ptime` of the first audio section, or None."""
    audio = False
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            audio = line.startswith("m=audio")
        elif audio and line.startswith("a=ptime:"):
            return int(line.split(":", 1)[1])
    return None


def answering_with_packet_time(handle_offer):
    """Wrap fastrtc's `handle_offer` so that its SDP answers ask for `PACKET_MS` packets."""

    async def handle_offer_with_packet_time(body, set_outputs):
        answer = await handle_offer(body, set_outputs)
        if isinstance(answer, dict) and answer.get("type") == "answer" and "sdp" in answer:
            answer = {**answer, "sdp": with_packet_time(answer["sdp"])}
        return answer

    return handle_offer_with_packet_time


def make_encoder_class():
    import fractions

    from aiortc.codecs.opus import OpusEncoder
    from av import AudioFifo, AudioResampler, CodecContext

    class PacketOpusEncoder(OpusEncoder):
        """aiortc's Opus encoder with `PACKET_MS` mono packets, encoding at the frames' own rate so
        that nothing waits in a resampler (the module docstring). Frames at a rate libopus does
        not take are resampled to 48 kHz, with no fixed frame size either."""

        def __init__(self) -> None:
            super().__init__()
            self._fifo: AudioFifo | None = None
            self._packet_samples = 0
            self._rtp_per_sample = fractions.Fraction(1)
            self._packets = 0

        def _open(self, frame) -> None:
            rate = frame.sample_rate if frame.sample_rate in OPUS_INPUT_RATES else OPUS_RATE
            codec = CodecContext.create("libopus", "w")
            # Mono: the agent speaks in one channel, and fastrtc's two are copies of it (a third
            # less encoding work per packet than stereo; every Opus decoder plays it).
            codec.bit_rate, codec.format, codec.layout, codec.sample_rate = self.codec.bit_rate, "s16", "mono", rate
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

    return PacketOpusEncoder


def make_inline_encoding():
    """aiortc's `RTCRtpSender._next_encoded_frame`, with an audio frame encoded on the event loop.

    aiortc hands every frame to a thread-pool executor to encode and back (and keeps its own
    Opus encoder for that reason off the loop). A 40 ms mono Opus packet takes libopus about
    0.2 ms, less than the hop itself costs (the executor's queue, a thread's wake-up, the future
    handed back through the loop's self-pipe): encoded in place, a packet costs the process less
    and waits for no thread. Video frames, which take longer, still go to the executor. The rest
    is aiortc 1.16's own, step for step."""
    from aiortc import rtcrtpsender as sender
    from aiortc import rtp
    from aiortc.rtcrtpsender import RTCEncodedFrame
    from av import AudioFrame
    from av.frame import Frame

    async def _next_encoded_frame(self, codec):
        data = await self._RTCRtpSender__track.recv()
        if not self._enabled:  # a disabled sender drops the frame, as aiortc's does
            return None
        audio_level = None
        if self._RTCRtpSender__encoder is None:
            self._RTCRtpSender__encoder = sender.get_encoder(codec)
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

    return _next_encoded_frame


class LoopDecoding:
    """One audio receiver's packets decoded on the event loop (`make_loop_decoder_worker`):
    `install` (on the loop) takes over the receiver's queue, whose `put` then decodes each packet
    in place and hands its frames straight to the track's queue."""

    def __init__(self, input_q, output_q, decode_error) -> None:
        self.input_q, self.output_q, self.decode_error = input_q, output_q, decode_error
        self.codec_name: str | None = None
        self.decoder = None
        self.stopped = False

    def install(self) -> None:
        """What arrived before this runs, then every later packet, in order."""
        import queue

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
    """In place of aiortc's `decoder_worker` (the thread each receiver starts): an audio
    receiver's packets decoded on the event loop, as each one arrives, into mono.

    aiortc decodes in a thread per receiver: each packet goes through a `queue.Queue` to it
    and each decoded frame back to the loop as a coroutine (`run_coroutine_threadsafe`), two
    thread hops per 40 ms packet, each costing more than decoding the packet (about 0.05 ms).
    Here the thread only hands the receiver's queue to the loop (`LoopDecoding`) and ends. Opus
    is decoded to mono (the caller's one microphone; the room takes mono), which spares the
    resampler a downmix. Video receivers keep aiortc's thread."""
    import threading

    from aiortc import rtcrtpreceiver as receiver

    threaded = receiver.decoder_worker

    def decoder_worker(loop, input_q, output_q, decode_error) -> None:
        if not threading.current_thread().name.startswith("audio"):
            threaded(loop, input_q, output_q, decode_error)
            return
        loop.call_soon_threadsafe(LoopDecoding(input_q, output_q, decode_error).install)

    return decoder_worker


def audio_level_dbov(frame) -> int:
    """An audio frame's level in dBov, 0 down to -127 (RFC 6465, Appendix A), as aiortc's own
    `aiortc.rtp.compute_audio_level_dbov` computes it, summed by numpy instead of a Python loop.

    The value is the same to the bit: the sum of squares of int16 samples is an integer well
    below 2**53, which aiortc's float accumulator also holds exactly, and the rest of the formula
    is aiortc's, step for step (same plane bytes, same `frame.samples` divisor)."""
    samples = np.frombuffer(frame.planes[0], dtype=np.int16).astype(np.int64)
    energy = float(samples @ samples)
    rms = math.sqrt(energy / (frame.samples * 32767 * 32767))
    if rms > 0:
        return round(min(max(20 * math.log10(rms), -127), 0))
    return -127


def make_jitter_buffer_class():
    from aiortc.jitterbuffer import JitterBuffer, JitterFrame
    from aiortc.utils import uint16_add

    class ArrivalJitterBuffer(JitterBuffer):
        """aiortc's jitter buffer for video; for audio, each packet released as it arrives (the
        module docstring). A packet older than one already released is dropped: its place on
        the timeline has been filled with silence (rtc/input_audio.py)."""

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

    return ArrivalJitterBuffer


def make_paced_callback_class():
    import asyncio
    import time

    from aiortc.mediastreams import MediaStreamError
    from fastrtc.tracks import AudioCallback, CloseStream
    from fastrtc.utils import create_message, current_channel

    class PacedAudioCallback(AudioCallback):
        """fastrtc's outgoing audio track, paced without an anchor (the module docstring): a
        packet waits only for the previous one's 40 ms, and only while nothing queues behind it."""

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
                        self._peeked = await asyncio.wait_for(self.queue.get(), self._next_due - now)
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

    return PacedAudioCallback
