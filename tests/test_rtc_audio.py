"""Audio on the wire: Opus in 40 ms packets, and what the receivers hold back."""

from __future__ import annotations

import asyncio
import fractions

import numpy as np
import pytest
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterFrame
from av import AudioFrame, AudioResampler

from personaplex_demo.rtc.audio import (
    PACKET_MS,
    ArrivalJitterBuffer,
    PacketOpusEncoder,
    answering_with_packet_time,
    output_frame_samples,
    with_packet_time,
)
from personaplex_demo.rtc.patches import install_jitter_buffer, install_packet_encoder


def packet_time(sdp: str) -> int | None:
    """The `a=ptime` of the first audio section, or None."""
    audio = False
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            audio = line.startswith("m=audio")
        elif audio and line.startswith("a=ptime:"):
            return int(line.split(":", 1)[1])
    return None


def test_packets_carry_40_ms_and_decode_to_the_same_tone():
    encoder, decoder = PacketOpusEncoder(), OpusDecoder()
    step = output_frame_samples(24000)  # what fastrtc hands the sender: 40 ms of 24 kHz stereo s16
    assert step == 960
    packets, stamps = [], []
    for n in range(50):  # 2 s
        t = (np.arange(step) + n * step) / 24000
        mono = (0.3 * 32767 * np.sin(2 * np.pi * 440.0 * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(np.repeat(mono, 2).reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 24000, n * step, fractions.Fraction(1, 24000)
        payloads, timestamp = encoder.encode(frame)
        assert len(payloads) == 1, n  # each 40 ms is a packet at once: nothing waits for the next frame
        packets += payloads
        stamps += [timestamp] * len(payloads)
    assert stamps[0] == 0
    assert not any(p[0] & 0x04 for p in packets)  # the TOC byte's stereo flag (RFC 6716, section 3.1): mono
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


def _released(buffer, seqs: list[int], step: int = 48 * PACKET_MS) -> list[int]:
    """Feed RTP packets with these sequence numbers (timestamps to match) into an audio jitter
    buffer built as aiortc's receiver builds it; after each one, the sequence numbers of the
    packets released, -1 for none."""
    from aiortc.rtp import RtpPacket

    out = []
    for seq in seqs:
        packet = RtpPacket(payload_type=111, sequence_number=seq & 0xFFFF, timestamp=(7 + seq * step) & 0xFFFFFFFF,
                           payload=b"\x01")
        packet._data = packet.payload  # what aiortc's receiver does after depacketizing
        _, frame = buffer.add(packet)
        out.append(-1 if frame is None else ((frame.timestamp - 7) // step) & 0xFFFF)
    return out


def test_the_callers_packets_are_released_as_they_arrive_and_a_loss_holds_nothing_back():
    from aiortc.jitterbuffer import JitterBuffer

    arrival = ArrivalJitterBuffer
    clean = list(range(1000, 1012))
    assert _released(arrival(capacity=16, prefetch=4), clean) == clean  # nothing held
    # aiortc's own holds back 4 packets on a clean link: 160 ms at the 40 ms asked for...
    assert _released(JitterBuffer(capacity=16, prefetch=4), clean)[:4] == [-1] * 4
    # ...and after one lost packet it releases nothing until 16 packets wait, then one per arrival:
    lost = [s for s in range(1000, 1040) if s != 1005]
    stuck = _released(JitterBuffer(capacity=16, prefetch=4), lost)
    assert stuck[5:19] == [-1] * 14  # 560 ms without a packet (and the 4 held ones never come out)
    assert [arrived - out for arrived, out in zip(lost[-10:], stuck[-10:])] == [14] * 10  # 560 ms behind for good
    assert _released(arrival(capacity=16, prefetch=4), lost) == lost  # here: each one as it arrives
    # A late packet (after a later one went) is dropped, a repeat too; the numbers wrap at 2**16.
    assert _released(arrival(capacity=16, prefetch=4), [10, 12, 11, 12, 13]) == [10, 12, -1, -1, 13]
    assert _released(arrival(capacity=16, prefetch=4), [65534, 65535, 65536, 65537]) == [65534, 65535, 0, 1]
    # A sender that restarts its numbering far behind is followed, not dropped for ever.
    assert _released(arrival(capacity=16, prefetch=4), [5000, 5001, 100, 101]) == [5000, 5001, 100, 101]


def test_install_gives_receivers_the_arrival_jitter_buffer_for_audio_only():
    import aiortc.rtcrtpreceiver as receiver

    before = receiver.JitterBuffer
    try:
        install_jitter_buffer()
        arrival = receiver.JitterBuffer
        install_jitter_buffer()  # idempotent
        assert receiver.JitterBuffer is arrival and arrival is not before
        assert _released(arrival(capacity=16, prefetch=4), [1, 2]) == [1, 2]
        video = arrival(capacity=512, is_video=True)
        assert video.add(__import__("aiortc.rtp").rtp.RtpPacket(sequence_number=1))[1] is None  # aiortc's own
    finally:
        receiver.JitterBuffer = before


async def test_a_waiting_callers_packets_are_dropped_before_decoding_and_taken_again_after():
    """aiortc's receiver switch, as `receive_audio` turns it: off, an arriving RTP packet goes
    no further than the receiver's first check (its source is not even noted, let alone decoded)."""
    from aiortc import RTCPeerConnection
    from aiortc.rtp import RtpPacket

    from personaplex_demo.rtc.patches import receive_audio

    pc = RTCPeerConnection()
    try:
        assert not receive_audio(pc, False)  # no audio receiver yet: nothing to switch
        pc.addTransceiver("audio", direction="recvonly")
        receiver = pc.getReceivers()[0]
        sources = receiver._RTCRtpReceiver__active_ssrc  # what the receiver notes of each packet first
        assert receive_audio(pc, False)
        await receiver._handle_rtp_packet(RtpPacket(payload_type=96, sequence_number=1, ssrc=11), arrival_time_ms=0)
        assert sources == {}
        assert receive_audio(pc, True)
        await receiver._handle_rtp_packet(RtpPacket(payload_type=96, sequence_number=2, ssrc=11), arrival_time_ms=0)
        assert list(sources) == [11]
    finally:
        await pc.close()


def _opus_packets(count: int) -> list:
    encoder = PacketOpusEncoder()
    out = []
    for n in range(count):
        t = (np.arange(960) + n * 960) / 24000
        frame = AudioFrame.from_ndarray((3000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16).reshape(1, -1),
                                        format="s16", layout="mono")
        frame.sample_rate = 24000
        payloads, timestamp = encoder.encode(frame)
        out += [JitterFrame(data=p, timestamp=timestamp) for p in payloads]
    return out


async def test_a_receivers_packets_are_decoded_on_the_loop_in_order_into_mono_and_its_end_ends_the_track():
    """The decoder thread only hands the receiver's queue over: packets queued before that and
    after it come out in order, each decoded as it is put, and None (the receiver stopped) ends
    the track."""
    import queue
    import threading

    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    from personaplex_demo.rtc.audio import make_loop_decoder_worker

    opus = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2)
    packets = _opus_packets(6)
    loop, input_q, output_q, error = asyncio.get_running_loop(), queue.Queue(), asyncio.Queue(), threading.Event()
    for packet in packets[:2]:  # before the worker ran: they wait in the receiver's queue
        input_q.put((opus, packet))
    worker = threading.Thread(target=make_loop_decoder_worker(), name="audio-decoder",
                              args=(loop, input_q, output_q, error))
    worker.start()
    worker.join(5)
    assert not worker.is_alive()  # no thread per receiver
    frames = [await asyncio.wait_for(output_q.get(), 5) for _ in range(2)]
    for packet in packets[2:]:
        input_q.put((opus, packet))  # what the receiver calls on the loop for each packet
        frames.append(output_q.get_nowait())  # decoded at once, in place
    input_q.put((opus, JitterFrame(data=b"\xff\xff\xff", timestamp=0)))  # not Opus: noted, skipped
    input_q.put(None)
    assert output_q.get_nowait() is None and error.is_set()
    assert "put" not in vars(input_q)  # the queue is aiortc's own again, and the decoder is let go
    assert [f.pts for f in frames] == [p.timestamp for p in packets]
    assert {(f.layout.name, f.samples, f.sample_rate) for f in frames} == {("mono", 1920, 48000)}


async def test_the_sender_encodes_audio_on_the_loop_and_keeps_aiortcs_packets():
    """`install_loop_codecs`: an audio frame is encoded in place (no executor), with its level
    and its RTP time, as aiortc's own sender would send it."""
    from unittest.mock import MagicMock

    from aiortc import MediaStreamTrack, RTCRtpSender
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    from personaplex_demo.rtc.patches import install_audio_level, install_loop_codecs, install_packet_encoder

    class Tone(MediaStreamTrack):
        kind = "audio"

        async def recv(self):
            frame = AudioFrame.from_ndarray(np.full((1, 960), 1000, np.int16), format="s16", layout="mono")
            frame.sample_rate = 24000
            return frame

    install_packet_encoder()
    install_audio_level()
    install_loop_codecs()
    patched = RTCRtpSender._next_encoded_frame
    install_loop_codecs()  # idempotent
    assert RTCRtpSender._next_encoded_frame is patched
    sender = RTCRtpSender(Tone(), MagicMock())  # a transport is not used before the first packet
    loop = asyncio.get_running_loop()
    used = []
    original = loop.run_in_executor
    loop.run_in_executor = lambda *a: used.append(a) or original(*a)
    try:
        opus = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
        first, second = [await sender._next_encoded_frame(opus) for _ in range(2)]
    finally:
        del loop.run_in_executor
    assert not used
    assert len(first.payloads) == 1 and second.timestamp - first.timestamp == 48000 * PACKET_MS // 1000
    assert first.audio_level == round(20 * np.log10(1000 / 32767))


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


def _decoded(seconds: float, packet_ms: int = PACKET_MS, rate: int = 48000):
    """What aiortc's Opus decoder hands fastrtc: s16 stereo frames of one packet each, with their
    RTP time (pts, 1/48000 s); a ramp in both channels, so that every sample can be followed."""
    step = rate * packet_ms // 1000
    out = []
    for n in range(int(seconds * 1000 / packet_ms)):
        ramp = (np.arange(step) + n * step) % 20000
        frame = AudioFrame.from_ndarray(np.repeat(ramp.astype(np.int16), 2).reshape(1, -1), format="s16",
                                        layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = rate, n * step, fractions.Fraction(1, rate)
        out.append(frame)
    return out


def test_the_callers_audio_comes_out_of_the_resampler_as_it_goes_in_and_a_lost_packet_keeps_its_place():
    from av import AudioResampler

    from personaplex_demo.rtc.audio import InputResampler

    frames = _decoded(2.0)
    ours = InputResampler(24000)
    out = [np.concatenate([f.to_ndarray().reshape(-1) for f in ours.resample(frame)]) for frame in frames]
    assert out[0].size > 900 and all(o.size == 960 for o in out[1:])  # at once, less the filter's ~16 samples
    # fastrtc's own (a fixed frame size) holds each packet until the next one is decoded:
    fixed = AudioResampler(format="s16", layout="mono", rate=24000, frame_size=frames[0].samples // 2)
    assert [sum(f.samples for f in fixed.resample(frame)) for frame in frames[:3]] == [0, 960, 960]
    # The same samples as one resampling of the whole, so none dropped or repeated.
    whole = AudioResampler(format="s16", layout="mono", rate=24000)
    once = np.concatenate([f.to_ndarray().reshape(-1) for frame in frames for f in whole.resample(frame)])
    assert np.array_equal(np.concatenate(out), once)
    # A lost packet: its 40 ms come out as silence, in its place; what follows is on time.
    lossy = InputResampler(24000)
    kept = frames[:10] + frames[11:]
    got = [np.concatenate([f.to_ndarray().reshape(-1) for f in lossy.resample(frame)]) for frame in kept]
    assert [g.size for g in got[9:11]] == [960, 960 + 960] and not got[10][:960].any()
    assert lossy.filled_samples == 960 and sum(g.size for g in got) == sum(o.size for o in out)
    # A pause longer than MAX_FILL_SECONDS (a sender that stopped, a stalled link) is not filled.
    paused = InputResampler(24000)
    for frame in frames[:5] + frames[30:]:
        list(paused.resample(frame))
    assert paused.filled_samples == 0


def test_agent_packets_are_spaced_40_ms_apart_without_an_anchor_a_late_first_frame_sets():
    """The outgoing track: an engine frame's two packets 40 ms apart, each later frame as it
    comes. fastrtc's own pacing anchors on the first frame: when the first frames come late and
    together (a slow first tick, then the catch-up), it paces them out at real time, and every
    later packet waits behind them for the rest of the call."""
    import asyncio
    import time

    from fastrtc.tracks import AudioCallback

    from personaplex_demo.rtc.audio import PacedAudioCallback

    def track(cls):
        cb = cls.__new__(cls)
        super(AudioCallback, cb).__init__()  # aiortc's AudioStreamTrack: a live track
        cb.event_handler = type("Handler", (), {"channel_set": asyncio.Event(), "channel": None,
                                                 "output_frame_size": 960, "output_sample_rate": 24000})()
        cb.event_handler.channel_set.set()
        cb.queue, cb._start, cb.last_timestamp, cb.channel = asyncio.Queue(), None, 0, None

        async def started():
            return None

        cb.start = started
        return cb

    def packet(n: int) -> AudioFrame:
        frame = AudioFrame.from_ndarray(np.zeros((1, 1920), np.int16), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 24000, n * 960, fractions.Fraction(1, 24000)
        return frame

    async def sent_after_produced(cls) -> list[float]:
        """Four engine frames (two packets each) at 0.2 s, then one every 80 ms: how long each
        frame's first packet waited on the track."""
        cb, begin = track(cls), time.monotonic()
        due, put, waited = [0.2] * 4 + [0.2 + 0.08 * k for k in range(1, 5)], [], []

        async def engine():
            for k, at in enumerate(due):
                await asyncio.sleep(max(0.0, begin + at - time.monotonic()))
                put.append(time.monotonic())  # when it really came (a busy host wakes late)
                cb.queue.put_nowait(packet(2 * k))
                cb.queue.put_nowait(packet(2 * k + 1))

        feeding = asyncio.create_task(engine())
        for k in range(len(due)):
            await cb.recv()
            waited.append(time.monotonic() - put[k])
            await cb.recv()
        await feeding
        return waited

    ours = asyncio.run(sent_after_produced(PacedAudioCallback))
    theirs = asyncio.run(sent_after_produced(AudioCallback))
    assert max(ours) < 0.03, ours  # each frame leaves as it comes (0.03: a loaded host's slack)
    assert min(theirs[4:]) > 0.2, theirs  # fastrtc's: 240 ms behind the first frames, for good


def _agent_items() -> list:
    """What a call handler emits, in the forms fastrtc takes: 80 ms float32 frames (the app's), a
    page update with one and alone, an odd-sized int16 piece, and the end."""
    from fastrtc import AdditionalOutputs, CloseStream

    rng = np.random.default_rng(7)
    tone = [(0.5 * np.sin(2 * np.pi * 300 * (np.arange(1920) + k * 1920) / 24000)).astype(np.float32)
            for k in range(4)]
    tone[1][:5] = [1.2, -1.3, 0.99999, -1.0, 0.5 / 32768]  # beyond full scale: clipped; half a step: rounded
    odd = rng.integers(-20000, 20000, 700).astype(np.int16)
    return [(24000, tone[0]), ((24000, tone[1]), AdditionalOutputs("hello")), AdditionalOutputs("status"),
            (24000, odd), (24000, tone[2]), (24000, tone[3]), CloseStream("bye")]


async def _worker_output(worker, items: list) -> tuple[list, list, list]:
    """Run a fastrtc audio worker over `items` as fastrtc's AudioCallback starts it, until they run out:
    what it queued, the updates it set and the data channel messages."""
    queue, quit_event, updates, sent = asyncio.Queue(), asyncio.Event(), [], []
    pending = list(items)

    async def next_frame():
        if not pending:
            quit_event.set()  # as the track's stop does
        return pending.pop(0) if pending else None

    channel = type("Channel", (), {"send": lambda self, message: sent.append(message)})()
    await asyncio.wait_for(worker(next_frame, queue, quit_event, lambda: channel, updates.append, False,
                                  24000, 960), 5)
    return [queue.get_nowait() for _ in range(queue.qsize())], updates, sent


async def test_the_agents_audio_leaves_as_fastrtcs_worker_sends_it_in_mono_without_its_resamplers():
    """`agent_audio_worker` against fastrtc 0.0.34's own `player_worker_decode` on the same items: the
    same page updates and data channel messages in the same order, the same 40 ms frames with the same
    times, in mono the audio that the Opus encoder took from fastrtc's stereo, and the end after them."""
    from fastrtc import CloseStream
    from fastrtc.utils import player_worker_decode

    from personaplex_demo.rtc.audio import agent_audio_worker

    theirs, their_updates, their_sent = await _worker_output(player_worker_decode, _agent_items())
    ours, our_updates, our_sent = await _worker_output(agent_audio_worker, _agent_items())
    assert [u.args for u in our_updates] == [u.args for u in their_updates] == [("hello",), ("status",)]
    assert our_sent == their_sent and len(our_sent) == 2
    assert isinstance(ours[-1], CloseStream) and ours[-1].msg == "bye" and isinstance(theirs[-1], CloseStream)
    ours, theirs = ours[:-1], theirs[:-1]
    assert len(ours) == len(theirs) == (4 * 1920 + 700) // 960  # what is left over waits for more
    # fastrtc's two channels are its mono at -3 dB each (libswresample's upmix), which the encoder's
    # resampler averaged back into one: the agent went out 3 dB below the model's level. Ours is at it.
    for mine, fastrtcs in zip(ours, theirs):
        assert (mine.format.name, mine.layout.name, mine.sample_rate, mine.samples) == ("s16", "mono", 24000, 960)
        assert (mine.pts, mine.time_base) == (fastrtcs.pts, fastrtcs.time_base)
        left, right = fastrtcs.to_ndarray().reshape(-1, 2).T.astype(np.float64)
        got = mine.to_ndarray().reshape(-1)
        clipped = slice(2) if mine.pts == 1920 else slice(0)  # 1.2 and -1.3: beyond full scale here only
        assert got[clipped].tolist() == ([32767, -32768] if mine.pts == 1920 else [])
        assert np.array_equal(left, right) and np.abs(np.sqrt(0.5) * got - left)[clipped.stop:].max() <= 1
    # Float to 16 bits as libswresample converts it (clipped, rounded half to even), to the bit:
    emitted = _agent_items()[1][0][1]
    planar = AudioFrame.from_ndarray(emitted.reshape(1, -1), format="fltp", layout="mono")
    planar.sample_rate = 24000
    (converted,) = AudioResampler(format="s16", layout="mono", rate=24000).resample(planar)
    assert np.array_equal(np.concatenate([f.to_ndarray() for f in ours[2:4]], axis=1), converted.to_ndarray())


def test_agent_frames_mix_stereo_and_refuse_audio_at_another_rate_or_layout_by_name():
    from fastrtc.utils import WebRTCError

    from personaplex_demo.rtc.audio import AgentFrames

    frames = AgentFrames(24000, 960)
    with pytest.raises(WebRTCError, match="emitted 16000 Hz audio; its track sends 24000 Hz"):
        frames.cut(16000, np.zeros(960, np.int16))
    with pytest.raises(WebRTCError, match="'5.1'"):
        frames.cut(24000, np.zeros((6, 960), np.int16), "5.1")
    with pytest.raises(WebRTCError, match=r"shape \(960, 2\); its track takes \(2, samples\)"):
        frames.cut(24000, np.zeros((960, 2), np.int16), "stereo")  # interleaved: not what fastrtc takes
    reused = np.arange(959, dtype=np.int16)
    assert frames.cut(24000, reused) == []
    reused[:] = 0  # the handler's buffer, filled again: what waits in AgentFrames is a copy
    (frame,) = frames.cut(24000, np.full(1, 7, np.int16))
    assert frame.to_ndarray()[0, [0, 958, 959]].tolist() == [0, 958, 7]
    # Planar stereo (one row per channel, as fastrtc takes it) is mixed into the one channel sent.
    left = np.linspace(-0.5, 0.5, 960, dtype=np.float32)
    (mixed,) = frames.cut(24000, np.stack([left, -0.5 * left]), "stereo")
    assert np.array_equal(mixed.to_ndarray().reshape(-1), np.rint(0.25 * left * 32768).astype(np.int16))


def test_a_packet_sized_mono_frame_is_encoded_as_it_is_into_the_packets_the_fifo_would_cut():
    """`PacketOpusEncoder`: 40 ms s16 mono frames (AgentFrames') skip the FIFO; the packets and RTP
    times are those of the same audio in pieces of other sizes, which go through it."""
    audio = (8000 * np.sin(2 * np.pi * 220 * np.arange(960 * 30) / 24000)).astype(np.int16)

    def encoded(sizes: list[int]) -> tuple[list[bytes], list[int], int]:
        """The packets, their RTP times, and the samples that went through the FIFO."""
        encoder, payloads, stamps, at = PacketOpusEncoder(), [], [], 0
        for size in sizes:
            frame = AudioFrame.from_ndarray(audio[at:at + size].reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, at = 24000, at + size
            got, stamp = encoder.encode(frame)
            payloads += got
            stamps += [stamp] * len(got)
        return payloads, stamps, encoder._fifo.samples_written

    direct, direct_stamps, through_fifo = encoded([960] * 30)
    assert len(direct) == 30 and direct_stamps == [k * 1920 for k in range(30)]
    assert through_fifo == 960  # the first frame only, before the resampler knew it has nothing to do
    pieces = encoded([700] + [960] * 29 + [260])  # each ends with 700 samples in the FIFO
    assert pieces[:2] == (direct, direct_stamps) and pieces[2] == 960 * 30
    emptied = encoded([700, 260] + [960] * 29)  # the FIFO empties, and packet-sized frames skip it again
    assert emptied[:2] == (direct, direct_stamps) and emptied[2] == 960


def test_install_gives_fastrtcs_tracks_the_agent_audio_worker():
    import fastrtc.tracks as tracks

    from personaplex_demo.rtc.audio import agent_audio_worker
    from personaplex_demo.rtc.patches import install_agent_frames

    before = tracks.player_worker_decode
    try:
        install_agent_frames()
        install_agent_frames()  # idempotent
        assert tracks.player_worker_decode is agent_audio_worker
    finally:
        tracks.player_worker_decode = before
