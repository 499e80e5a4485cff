"""The agent's audio from a call handler to Opus packets, per 40 ms packet: fastrtc 0.0.34's own worker
(`player_worker_decode`: planar float, resampled to stereo, then the encoder's resampler back to mono)
against `agent_audio_worker` (s16 mono frames, the encoder's resampler a pass-through), each with the
app's `PacketOpusEncoder` and the packet's audio level, as the sender does. The two run in turns in
one process, on the same 80 ms frames; CPU time (time.process_time) per packet.

    python bench/agent_audio.py [--frames 500] [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, md_table, publish  # noqa: E402
from personaplex_demo.rtc.audio import PacketOpusEncoder, agent_audio_worker, audio_level_dbov  # noqa: E402

SECTION = "Page callers: the agent's audio straight to the encoder, per packet"


async def per_packet(worker, frames: list) -> float:
    """CPU seconds per packet: the worker cuts the handler's frames, the encoder makes the packets."""
    queue, done = asyncio.Queue(), asyncio.Event()
    items = iter(frames)

    async def emit():
        item = next(items, None)
        if item is None:
            done.set()  # the track's stop
        return item

    encoder, packets = PacketOpusEncoder(), 0
    began = time.process_time()
    await worker(emit, queue, done, None, None, False, 24000, 960)
    while not queue.empty():
        frame = queue.get_nowait()
        audio_level_dbov(frame)
        packets += len(encoder.encode(frame)[0])
    return (time.process_time() - began) / packets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=500, help="80 ms frames per turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from fastrtc.utils import player_worker_decode

    rng = np.random.default_rng(0)
    frames = [(24000, (0.2 * rng.standard_normal(1920)).astype(np.float32)) for _ in range(args.frames)]
    cases = {"fastrtc's worker": player_worker_decode, "agent_audio_worker": agent_audio_worker}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds + 1):
        for name in (list(cases) if r % 2 else list(cases)[::-1]):
            seconds = asyncio.run(per_packet(cases[name], frames))
            if r:  # the first round warms both up
                times[name].append(seconds)
    base = statistics.median(times["fastrtc's worker"])
    rows = [[name, f"{statistics.median(t) * 1e6:.0f} µs", f"{min(t) * 1e6:.0f}-{max(t) * 1e6:.0f} µs",
             f"{statistics.median(t) / base:.2f}", f"{statistics.median(t) * 25:.4f}"] for name, t in times.items()]
    body = md_table(["path", "CPU per 40 ms packet (median)", "range over rounds", "against fastrtc's",
                     "cores per caller (25 packets/s)"], rows)
    publish(SECTION, body + f"\n\nLoad average before: {loadavg()}.", args.write)


if __name__ == "__main__":
    main()
