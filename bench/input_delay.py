"""How long a caller's sound takes to come out of the server's WebRTC receiver, over loopback.

Two aiortc peers in one process: the caller's track sends silence in real time (20 ms frames, as
a microphone does) with a loud 20 ms frame once a second; the other peer reads its remote track as
fastrtc does and notes when each loud frame comes out. The delay covers Opus packetization, SRTP,
the loopback network, aiortc's jitter buffer and its decoder thread; not the engine. Cases, in
one run and interleaved: 20 ms packets (aiortc's default) and 40 ms packets (what the app asks
browsers for), each with aiortc's own jitter buffer (4 packets held back) and with
`rtc/audio.py`'s `ArrivalJitterBuffer` (each packet released as it arrives), the one the app installs.

    python bench/input_delay.py [--seconds 10] [--rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import md_table, replace_section  # noqa: E402
from personaplex_demo.rtc.audio import PACKET_MS, ArrivalJitterBuffer  # noqa: E402
from personaplex_demo.rtc.patches import install_packet_encoder  # noqa: E402

log = logging.getLogger("bench.input_delay")
SECTION = "Caller's audio into the server"
FRAME_S = 0.02
BURST_EVERY = 50  # frames: one loud frame a second


async def one_run(packet_ms: int, timed: bool, seconds: float) -> list[float]:
    """Delays (s) of the loud frames after the first, for one pair of peers."""
    import aioice.ice
    import aiortc.rtcrtpreceiver as receiver
    import aiortc.rtcrtpsender as sender
    from aiortc import MediaStreamTrack, RTCPeerConnection
    from aiortc.jitterbuffer import JitterBuffer
    from aiortc.mediastreams import MediaStreamError
    from av import AudioFrame

    from personaplex_demo.rtc.patches import loopback_host_addresses

    aioice.ice.get_host_addresses = loopback_host_addresses
    original_encoder = sender.get_encoder
    receiver.JitterBuffer = ArrivalJitterBuffer if timed else JitterBuffer
    if packet_ms == PACKET_MS:
        install_packet_encoder()
    sent: dict[int, float] = {}
    came_out: dict[int, float] = {}

    class Microphone(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.n, self.t0 = 0, None

        async def recv(self) -> AudioFrame:
            self.t0 = self.t0 or time.monotonic()
            await asyncio.sleep(max(0.0, self.t0 + self.n * FRAME_S - time.monotonic()))
            loud = self.n % BURST_EVERY == BURST_EVERY // 2
            frame = AudioFrame.from_ndarray(np.full((1, 960), 20000 if loud else 0, np.int16), format="s16",
                                            layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
            if loud:
                sent[self.n // BURST_EVERY] = time.monotonic()
            self.n += 1
            return frame

    async def listen(track) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:  # the call ended
                return
            if sent and np.abs(frame.to_ndarray()).max() > 5000:
                came_out.setdefault(max(sent), time.monotonic())

    caller, server = RTCPeerConnection(), RTCPeerConnection()
    tasks: list[asyncio.Task] = []
    try:
        caller.addTrack(Microphone())
        server.on("track", lambda track: tasks.append(asyncio.ensure_future(listen(track))))
        await caller.setLocalDescription(await caller.createOffer())
        await server.setRemoteDescription(caller.localDescription)
        await server.setLocalDescription(await server.createAnswer())
        await caller.setRemoteDescription(server.localDescription)
        await asyncio.sleep(seconds)
    finally:
        for task in tasks:
            task.cancel()
        await caller.close()
        await server.close()
        sender.get_encoder = original_encoder
        receiver.JitterBuffer = JitterBuffer
    return [came_out[k] - sent[k] for k in sorted(came_out)[1:]]  # the first waits for the connection


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each case, interleaved")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("aiortc", "aioice"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cases = [(20, False), (20, True), (PACKET_MS, False), (PACKET_MS, True)]
    delays: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _ in range(a.rounds):
        for packet_ms, timed in cases:
            got = asyncio.run(one_run(packet_ms, timed, a.seconds))
            log.info("%d ms packets, %s buffer: %s ms", packet_ms, "arrival" if timed else "aiortc's",
                     [round(1e3 * d) for d in got])
            delays[(packet_ms, timed)] += got
    rows = []
    for packet_ms, timed in cases:
        d = 1e3 * np.array(delays[(packet_ms, timed)])
        rows.append([f"{packet_ms} ms", "released on arrival (the app's)" if timed else "aiortc's: 4 packets held back",
                     len(d), f"{np.median(d):.0f}", f"{d.min():.0f}-{d.max():.0f}"])
    body = md_table(["packets", "jitter buffer", "sounds", "delay median (ms)", "range (ms)"], rows)
    print(body)
    if a.write:
        replace_section(SECTION, body + "\n\n" + __doc__.split("\n\n")[1].replace("\n", " ") + "\n")
        log.info("wrote BENCHMARKS.md § %s", SECTION)


if __name__ == "__main__":
    main()
