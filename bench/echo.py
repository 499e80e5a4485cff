"""What the speaker-echo check (web/echo.py) costs a host: per call per second, its envelope
updates (25 microphone chunks of 40 ms and 12.5 agent frames of 80 ms) and its one check, timed
for a room of callers on one core, beside the real-time budget of that second.

    python bench/echo.py [--callers 64] [--seconds 10] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, md_table, replace_section  # noqa: E402
from personaplex_demo.web.echo import EchoDetector  # noqa: E402


def run(callers: int, seconds: float) -> tuple[float, float]:
    """Seconds of CPU per call per second of audio: (envelope updates, checks)."""
    rng = np.random.default_rng(0)
    mic = (0.1 * rng.standard_normal(960)).astype(np.float32)
    agent = (0.1 * rng.standard_normal(1920)).astype(np.float32)
    detectors = [EchoDetector() for _ in range(callers)]
    update = check = 0.0
    t = 1000.0
    for step in range(int(seconds / 0.04)):
        t += 0.04
        began = time.perf_counter()
        for d in detectors:
            d.caller.add(mic, t)
            if step % 2:
                d.agent.add(agent, t)
        middle = time.perf_counter()
        for d in detectors:
            d.check(t)
        update += middle - began
        check += time.perf_counter() - middle
    return update / (callers * seconds), check / (callers * seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    update, check = run(args.callers, args.seconds)
    per_call = update + check
    rows = [[args.callers, f"{update * 1e6:.0f} µs", f"{check * 1e6:.0f} µs", f"{per_call * 1e6:.0f} µs",
             f"{per_call * args.callers * 1e3:.1f} ms", f"{per_call * args.callers:.2%}"]]
    body = (md_table(["callers", "envelopes per call per s", "checks per call per s", "per call per s",
                      "whole room per s", "of one core"], rows)
            + "\n\nThe check runs on each call's own event loop (the page's process or its media worker), "
              "outside the engine's tick.")
    print(body)
    if args.write:
        replace_section("Speaker-echo check: cost per call", body, extra=f"load average before: {loadavg()}")


if __name__ == "__main__":
    main()
