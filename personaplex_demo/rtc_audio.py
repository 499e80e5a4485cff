"""The agent's audio on the wire: Opus in 40 ms packets instead of aiortc's 20 ms.

Every outgoing packet costs the one event loop that all callers share a fixed amount of work
besides the codec itself: fastrtc's real-time pacing wakes up once per frame, aiortc hands each
frame to a thread-pool executor to encode and back, computes its audio level, encrypts the packet
(SRTP) and sends a datagram. At 20 ms that is 50 round trips a second per caller. The engine
produces audio in 80 ms frames anyway, so 40 ms packets halve that work and add no delay: the
whole 80 ms frame is there at once, and a 40 ms packet leaves as soon as its 40 ms are paced
out. Browsers decode any Opus frame length (RFC 6716); the codec is still libopus through PyAV,
as in aiortc, with aiortc's own settings but for the frame length.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PACKET_MS = 40
OPUS_RATE = 48000  # Opus on the wire is always 48 kHz (RTP clock)


def output_frame_samples(sample_rate: int) -> int:
    """fastrtc's output frame length for `sample_rate` audio, matched to one Opus packet."""
    return sample_rate * PACKET_MS // 1000


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


def install_packet_encoder() -> None:
    """Make aiortc's senders in this process encode Opus in `PACKET_MS` packets. Idempotent.

    aiortc picks an encoder per negotiated codec through `aiortc.rtcrtpsender.get_encoder`;
    other codecs keep aiortc's own encoders."""
    import aiortc.rtcrtpsender as sender

    if getattr(sender.get_encoder, "packet_ms", None) == PACKET_MS:
        return
    original = sender.get_encoder
    encoder_class = make_encoder_class()

    def get_encoder(codec):
        if codec.mimeType.lower() == "audio/opus":
            return encoder_class()
        return original(codec)

    get_encoder.packet_ms = PACKET_MS
    sender.get_encoder = get_encoder
    log.debug("outgoing Opus in %d ms packets", PACKET_MS)
