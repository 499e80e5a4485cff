"""Audio on the wire in 40 ms Opus packets instead of WebRTC's usual 20 ms, both ways.

Every outgoing packet costs the one event loop that all callers share a fixed amount of work
besides the codec itself: fastrtc's real-time pacing wakes up once per frame, aiortc hands each
frame to a thread-pool executor to encode and back, computes its audio level, encrypts the packet
(SRTP) and sends a datagram. At 20 ms that is 50 round trips a second per caller. The engine
produces audio in 80 ms frames anyway, so 40 ms packets halve that work and add no delay: the
whole 80 ms frame is there at once, and a 40 ms packet leaves as soon as its 40 ms are paced
out. Browsers decode any Opus frame length (RFC 6716); the codec is still libopus through PyAV,
as in aiortc, with aiortc's own settings but for the frame length.

The caller's side costs the same per packet (decrypting, a hop to aiortc's decoder thread and
back, fastrtc's resampler, a `receive` call). `a=ptime:40` in the SDP answer asks the browser for
40 ms packets, and Chromium honours it. An engine frame (80 ms) is complete when its last packet
arrives, whatever the packet length. aiortc's receiver, though, holds back 4 packets in its audio
jitter buffer before it decodes one, which is 80 ms at 20 ms a packet but 160 ms at 40 ms: the
receivers here hold back `PREFETCH_MS` of audio instead (`TimedJitterBuffer`), whatever the
packet length, so the longer packets add no delay.

aiortc also measures every outgoing frame's audio level (the RTP header extension browsers use
to show who speaks) in a Python loop over the samples: about a tenth of the event loop's busy
time with 4 callers. `audio_level_dbov` computes the same value with numpy.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

PACKET_MS = 40
OPUS_RATE = 48000  # Opus on the wire is always 48 kHz (RTP clock)
# What aiortc's audio jitter buffer holds back at WebRTC's usual packet length: 4 packets of 20 ms.
PREFETCH_MS = 80


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
    from aiortc.codecs.opus import OpusEncoder
    from av import AudioResampler

    class PacketOpusEncoder(OpusEncoder):
        """aiortc's Opus encoder with `PACKET_MS` frames: one packet per 40 ms of audio."""

        def __init__(self) -> None:
            super().__init__()
            self.codec.options = {"application": "voip", "frame_duration": str(PACKET_MS)}
            self.resampler = AudioResampler(format="s16", layout="stereo", rate=OPUS_RATE,
                                            frame_size=OPUS_RATE * PACKET_MS // 1000)

    return PacketOpusEncoder


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


def prefetch_packets(packet_samples: int) -> int:
    """Packets to hold back so that they cover `PREFETCH_MS` of audio: 4 of 20 ms, 2 of 40 ms."""
    return max(1, -(-OPUS_RATE * PREFETCH_MS // 1000 // packet_samples))


def make_jitter_buffer_class():
    from aiortc.jitterbuffer import JitterBuffer

    class TimedJitterBuffer(JitterBuffer):
        """aiortc's jitter buffer, holding back `PREFETCH_MS` of audio rather than 4 packets.

        The packet length is read off the RTP timestamps of consecutive packets (48 kHz clock),
        so a browser that ignores `a=ptime` still gets aiortc's usual 80 ms. Video buffers (no
        prefetch) are aiortc's own."""

        def __init__(self, capacity: int, prefetch: int = 0, is_video: bool = False) -> None:
            super().__init__(capacity, prefetch, is_video)
            self._timed = prefetch > 0 and not is_video
            self._last_timestamp: int | None = None

        def add(self, packet):
            if self._timed:
                if self._last_timestamp is not None:
                    step = (packet.timestamp - self._last_timestamp) & 0xFFFFFFFF
                    # Opus packets carry 2.5 to 120 ms; anything else is a loss or reordering.
                    if 0 < step <= OPUS_RATE * 120 // 1000:
                        self._prefetch = prefetch_packets(step)
                self._last_timestamp = packet.timestamp
            return super().add(packet)

    return TimedJitterBuffer
