"""Audio on the wire: Opus in 40 ms packets, and what the receivers hold back."""

from __future__ import annotations

import fractions

import numpy as np
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterFrame
from av import AudioFrame

from personaplex_demo.rtc.audio import (
    PACKET_MS,
    PREFETCH_MS,
    answering_with_packet_time,
    make_encoder_class,
    make_jitter_buffer_class,
    output_frame_samples,
    packet_time,
    with_packet_time,
)
from personaplex_demo.rtc.patches import install_jitter_buffer, install_packet_encoder


def test_packets_carry_40_ms_and_decode_to_the_same_tone():
    encoder, decoder = make_encoder_class()(), OpusDecoder()
    step = output_frame_samples(24000)  # what fastrtc hands the sender: 40 ms of 24 kHz stereo s16
    assert step == 960
    packets, stamps = [], []
    for n in range(50):  # 2 s
        t = (np.arange(step) + n * step) / 24000
        mono = (0.3 * 32767 * np.sin(2 * np.pi * 440.0 * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(np.repeat(mono, 2).reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 24000, n * step, fractions.Fraction(1, 24000)
        payloads, timestamp = encoder.encode(frame)
        packets += payloads
        stamps += [timestamp] * len(payloads)
    assert 48 <= len(packets) <= 50  # one packet per 40 ms (the resampler holds back a few samples)
    assert set(np.diff(stamps)) == {48000 * PACKET_MS // 1000}  # RTP timestamps advance 40 ms a packet
    frames = [f for p, ts in zip(packets, stamps) for f in decoder.decode(JitterFrame(data=p, timestamp=ts))]
    assert {f.samples for f in frames} == {48000 * PACKET_MS // 1000}
    pcm = np.concatenate([f.to_ndarray().reshape(-1, 2)[:, 0] for f in frames]).astype(np.float64)[9600:]
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
    assert abs(np.argmax(spectrum) * 48000 / pcm.size - 440.0) < 3.0
    assert np.sqrt((pcm**2).mean()) > 0.15 * 32767  # 0.3 peak is 0.21 rms; Opus keeps the level


def test_install_routes_only_opus_to_the_packet_encoder():
    import aiortc.rtcrtpsender as sender
    from aiortc.codecs.g711 import PcmuEncoder
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    before = sender.get_encoder
    try:
        install_packet_encoder()
        wrapper = sender.get_encoder
        install_packet_encoder()  # idempotent: no wrapper around the wrapper
        assert sender.get_encoder is wrapper and wrapper is not before
        opus = sender.get_encoder(RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2))
        pcmu = sender.get_encoder(RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8000, channels=1))
        assert type(opus).__name__ == "PacketOpusEncoder" and isinstance(pcmu, PcmuEncoder)
    finally:
        sender.get_encoder = before


ANSWER = "\r\n".join([
    "v=0", "o=- 1 1 IN IP4 127.0.0.1", "s=-", "t=0 0", "a=group:BUNDLE 0 1",
    "m=audio 9 UDP/TLS/RTP/SAVPF 111", "c=IN IP4 127.0.0.1", "a=mid:0", "a=rtpmap:111 opus/48000/2",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "c=IN IP4 127.0.0.1", "a=mid:1", "",
])


def test_the_answer_asks_for_40_ms_packets_in_the_audio_section_only():
    sdp = with_packet_time(ANSWER)
    audio, data = sdp.split("m=application")
    assert audio.endswith("a=rtpmap:111 opus/48000/2\r\na=ptime:40\r\n") and "ptime" not in data
    assert packet_time(sdp) == 40 and packet_time(ANSWER) is None
    assert with_packet_time(sdp) == sdp  # an existing ptime is left alone
    assert packet_time(with_packet_time(ANSWER.rstrip("\r\n"))) == 40


async def test_only_answers_are_rewritten():
    async def handle_offer(body, set_outputs):
        return body

    wrapped = answering_with_packet_time(handle_offer)
    assert packet_time((await wrapped({"sdp": ANSWER, "type": "answer"}, None))["sdp"]) == 40
    refused = {"status": "failed", "meta": {"error": "concurrency_limit_reached"}}
    assert await wrapped(refused, None) == refused


def _frames():
    """Frames as aiortc's senders see them: fastrtc's 24 kHz stereo, a 48 kHz mono microphone,
    silence, full scale both ways, a lone sample and very quiet noise (below -127 dBov)."""
    rng = np.random.default_rng(0)
    out = []
    for layout, samples, rate in [("stereo", 960, 24000), ("mono", 960, 48000), ("mono", 1920, 48000)]:
        channels = 2 if layout == "stereo" else 1
        for scale in [0, 1, 30, 3000, 32767]:
            pcm = np.clip(rng.standard_normal(samples * channels) * scale, -32768, 32767).astype(np.int16)
            out.append((pcm, layout, rate))
    out.append((np.full(960, -32768, np.int16), "mono", 48000))
    out.append((np.full(960, 32767, np.int16), "mono", 48000))
    lone = np.zeros(960, np.int16)
    lone[17] = 1
    out.append((lone, "mono", 48000))
    frames = []
    for pcm, layout, rate in out:
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = rate
        frames.append(frame)
    return frames


def test_the_audio_level_is_aiortcs_to_the_bit():
    from aiortc.rtp import compute_audio_level_dbov

    from personaplex_demo.rtc.audio import audio_level_dbov

    levels = [(audio_level_dbov(f), compute_audio_level_dbov(f)) for f in _frames()]
    assert all(ours == theirs and type(ours) is type(theirs) for ours, theirs in levels), levels
    assert {theirs for _, theirs in levels} >= {0, -127}  # the clamps at both ends were exercised
    assert len({theirs for _, theirs in levels}) >= 6


def test_install_makes_the_sender_use_the_numpy_level():
    import aiortc.rtp as rtp

    from personaplex_demo.rtc.audio import audio_level_dbov
    from personaplex_demo.rtc.patches import install_audio_level

    before = rtp.compute_audio_level_dbov
    try:
        install_audio_level()
        install_audio_level()
        assert rtp.compute_audio_level_dbov is audio_level_dbov
    finally:
        rtp.compute_audio_level_dbov = before


def _held_back_ms(buffer_class, packet_ms: int, packets: int = 12) -> list[int]:
    """Feed `packets` RTP packets of `packet_ms` each into an audio jitter buffer built as
    aiortc's receiver builds it; for each frame that comes out, how much later audio had arrived."""
    from aiortc.rtp import RtpPacket

    buffer, step, out = buffer_class(capacity=16, prefetch=4), 48 * packet_ms, []
    for n in range(packets):
        packet = RtpPacket(payload_type=111, sequence_number=1000 + n, timestamp=7 + n * step, payload=b"\x01")
        packet._data = packet.payload  # what aiortc's receiver does after depacketizing
        _, frame = buffer.add(packet)
        if frame is not None:
            out.append((n * step - frame.timestamp + 7) // 48)
    return out


def test_the_callers_audio_is_held_back_80_ms_whatever_the_packet_length():
    from aiortc.jitterbuffer import JitterBuffer

    timed = make_jitter_buffer_class()
    # aiortc holds back 4 packets: 80 ms at WebRTC's usual 20 ms, but 160 ms at the 40 ms asked for.
    assert set(_held_back_ms(JitterBuffer, 20)) == {80} and set(_held_back_ms(JitterBuffer, 40)) == {160}
    for packet_ms in (20, 40, 80):
        held = _held_back_ms(timed, packet_ms)
        assert set(held) == {PREFETCH_MS}, (packet_ms, held)
        assert len(held) == 12 - PREFETCH_MS // packet_ms  # every later packet releases one frame
    assert set(_held_back_ms(timed, 60)) == {120}  # never less than PREFETCH_MS: 2 packets of 60 ms


def test_install_gives_receivers_the_timed_jitter_buffer_for_audio_only():
    import aiortc.rtcrtpreceiver as receiver

    before = receiver.JitterBuffer
    try:
        install_jitter_buffer()
        timed = receiver.JitterBuffer
        install_jitter_buffer()  # idempotent
        assert receiver.JitterBuffer is timed and timed is not before
        assert not timed(capacity=512, is_video=True)._timed and timed(capacity=16, prefetch=4)._timed
    finally:
        receiver.JitterBuffer = before


def test_every_patched_library_is_pinned_at_the_version_its_patches_were_written_for():
    from pathlib import Path

    from personaplex_demo.rtc.patches import WRITTEN_FOR, written_for

    pins = dict(line.split("==") for line in (Path(__file__).resolve().parent.parent / "requirements.txt")
                .read_text().splitlines() if "==" in line and not line.startswith("#"))
    assert {name: pins.get(name) for name in WRITTEN_FOR} == WRITTEN_FOR
    assert all(written_for(name) for name in WRITTEN_FOR)  # and those are the ones installed


def test_a_patch_of_another_version_is_named_in_the_log(monkeypatch, caplog):
    from personaplex_demo.rtc import patches

    monkeypatch.setitem(patches.WRITTEN_FOR, "aioice", "0.0.1")
    patches.written_for.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="personaplex_demo.rtc.patches"):
            assert not patches.written_for("aioice")
        assert "aioice 0.13.0 is installed; this app's patches of it were written for 0.0.1" in caplog.text
    finally:
        patches.written_for.cache_clear()
