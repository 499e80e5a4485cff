"""The app with a loopback engine, for measuring the round trip through the browser.

Each caller hears their own microphone back one frame (80 ms of audio) after the tick that took
it: the engine's own causal delay, measured on the lockstep engine (an input frame first changes
the output of the next step, from its first sample: docs/engine.md § Causal delay).
Everything else is the app as it is served: the model still runs every tick (so a tick costs what
it costs), the pool, the media path (embedded or in media workers), the page. A click sent from
the browser therefore comes back after the model's floor (160 ms: its frame, then the next) plus
everything the serving path adds. This is a measuring tool, never a model the app offers.

    python bench/loopback_app.py --model tiny [app flags]

Engine processes are spawned children that import this file again as their main module
(`__mp_main__`), so the loopback is installed there too; media workers (no torch) are left alone.
Importing it anywhere else installs nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOPBACK_FRAMES = 1  # the engine's own causal delay: one step (docs/engine.md § Causal delay)


def loop_back(engine) -> None:
    """Make `engine` (a LockstepEngine) answer each row with that row's input, late by
    LOOPBACK_FRAMES frames: silence until then, and again from each new session's start. The
    model still runs every step."""
    step, start_session = engine.step, engine.start_session
    lines: dict[int, collections.deque] = {}

    def fresh_line() -> collections.deque:
        return collections.deque(np.zeros((LOOPBACK_FRAMES, engine.frame_size), np.float32))

    def looped_step(pcm: np.ndarray):
        out = step(pcm)
        heard = engine.sanitize(pcm)
        said = np.zeros_like(heard)
        for row in range(engine.batch_size):
            line = lines.setdefault(row, fresh_line())
            line.append(heard[row].copy())
            said[row] = line.popleft()
        live = out.live if out.live is not None else np.ones(engine.batch_size, bool)
        return dataclasses.replace(out, pcm=np.where(live[:, None], said, 0.0).astype(np.float32))

    def looped_start(slot: int, *args, **kwargs):
        lines[slot] = fresh_line()
        return start_session(slot, *args, **kwargs)

    engine.step, engine.start_session = looped_step, looped_start


def install() -> None:
    """Every runtime this process builds gets a loopback engine. Runs before the app's modules
    import `build_runtime`, so they import this one."""
    from personaplex_demo.runtime import build

    original = build.build_runtime

    def build_looped(*args, **kwargs):
        runtime = original(*args, **kwargs)
        loop_back(runtime.engine)
        return runtime

    build.build_runtime = build_looped


# As the app's entry point (`__main__`) or its spawned children's copy of it (`__mp_main__`), never
# on a plain import (tests import `loop_back`); media workers do not build a runtime.
if __name__ in ("__main__", "__mp_main__") and not multiprocessing.current_process().name.startswith("media-worker"):
    install()

if __name__ == "__main__":
    from personaplex_demo.cli.app import main

    sys.exit(main())
