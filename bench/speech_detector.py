"""What the speech detector of the API doors costs (docs/realtime.md § Speech events): silero-vad
on 80 ms frames of espeak-ng speech with pauses, in the detector's one worker thread.

- worker time per frame, for one socket and for many sockets' detectors taking turns in the
  thread (each socket has its own model state), and what that makes the number of sockets one
  worker thread can follow in real time;
- event-loop time per frame: what `SpeechEvents.hear` costs the loop that hands the frame over.

    python bench/speech_detector.py [--frames 400] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import soundfile  # noqa: E402

from bench.common import md_table, publish  # noqa: E402
from personaplex_demo.api.speech_detector import SpeechConfig, SpeechDetector, SpeechEvents  # noqa: E402
from personaplex_demo.frame import FRAME_SAMPLES  # noqa: E402

SECTION = "What the API doors' speech detector costs"


def speech(folder: Path, seconds: float) -> np.ndarray:
    """espeak-ng sentences with a second of quiet between them, `seconds` long, 24 kHz int16."""
    raw, wav = folder / "raw.wav", folder / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), "Hello there. Can you tell me about the weather on Mars today?"],
                   check=True)
    subprocess.run(["sox", str(raw), "-r", "24000", "-c", "1", "-b", "16", str(wav)], check=True)
    one, _ = soundfile.read(wav, dtype="int16")
    piece = np.concatenate([one, np.zeros(24000, np.int16)])
    return np.tile(piece, int(seconds * 24000 / piece.size) + 1)[:int(seconds * 24000)]


def worker_ms_per_frame(pcm: np.ndarray, sockets: int, frames: int) -> float:
    """Median over rounds of worker time per frame, `sockets` detectors taking turns frame by frame."""
    detectors = [SpeechDetector(SpeechConfig()) for _ in range(sockets)]
    for detector in detectors:  # load and warm the TorchScript model (its first calls profile)
        for k in range(20):
            detector.hear([pcm[k * FRAME_SAMPLES:(k + 1) * FRAME_SAMPLES]])
    per_round = []
    for start in range(20, 20 + frames, 20):
        t0 = time.perf_counter()
        for k in range(start, start + 20):
            frame = pcm[(k % (pcm.size // FRAME_SAMPLES)) * FRAME_SAMPLES:][:FRAME_SAMPLES]
            for detector in detectors:
                detector.hear([frame])
        per_round.append((time.perf_counter() - t0) / (20 * sockets))
    return 1000 * float(np.median(per_round))


async def loop_us_per_frame(pcm: np.ndarray, frames: int) -> float:
    events = SpeechEvents(SpeechConfig(), lambda kind, ms: None)
    spent = []
    for k in range(frames):
        frame = pcm[(k % (pcm.size // FRAME_SAMPLES)) * FRAME_SAMPLES:][:FRAME_SAMPLES]
        t0 = time.perf_counter()
        events.hear(frame)
        spent.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    events.close()
    return 1e6 * float(np.median(spent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--write", action="store_true", help="write the section into BENCHMARKS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pcm = speech(Path(tempfile.mkdtemp()), 40.0)
    rows = []
    for sockets in (1, 8, 32):
        ms = worker_ms_per_frame(pcm, sockets, args.frames)
        rows.append([sockets, f"{ms:.2f}", f"{ms / 80:.1%}", f"{int(80 / ms)}"])
    loop_us = asyncio.run(loop_us_per_frame(pcm, 200))
    body = md_table(["sockets taking turns", "worker ms per 80 ms frame", "of one core per socket",
                     "sockets one worker thread follows in real time"], rows)
    body += (f"\n\nThe event loop's part, `SpeechEvents.hear` (hand the frame over, start the worker when idle): "
             f"{loop_us:.0f} µs per frame (median of 200).\n")
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
