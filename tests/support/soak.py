"""Soak: many simulated callers churning against a small pool with the tiny model.

Callers connect, talk, hang up, vanish without hanging up (idle release), hang up while queued or
during prefill, and send bad input. At the end every slot must be free and the queue empty.

    python -m tests.support.soak --seconds 600 --slots 4 --callers 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from personaplex_demo.call_settings import SamplingParams
from personaplex_demo.errors import CallerError
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import CallEnded, CallState, PoolFullError

log = logging.getLogger(__name__)


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class SoakReport:
    seconds: float
    slots: int
    callers: int
    calls: int = 0
    live_calls: int = 0
    refused_full: int = 0
    refused_bad_input: int = 0
    vanished: int = 0
    released_early: int = 0
    frames_out: int = 0
    end_reasons: dict[str, int] = field(default_factory=dict)
    unexpected_errors: list[str] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    slots_free_at_end: int = 0
    queue_at_end: int = 0
    pool: dict = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return (not self.unexpected_errors and self.slots_free_at_end == self.slots and self.queue_at_end == 0
                and self.live_calls > 0)


async def _caller(pool: SlotPool, voices: list[str], rng: random.Random, stop_at: float, rep: SoakReport) -> None:
    frame = (0.2 * np.sin(np.arange(1920) * 0.05)).astype(np.float32)
    while time.monotonic() < stop_at:
        kind = rng.random()
        voice = rng.choice(voices) if kind > 0.05 else rng.choice(["../../x", "NOPE", "/etc/passwd"])
        persona = "You enjoy having a good conversation." if kind < 0.9 else "x" * 100_000
        rep.calls += 1
        try:
            call = pool.admit(voice, persona, SamplingParams(seed=rng.randrange(2**31)))
        except CallerError:
            rep.refused_bad_input += 1
            await asyncio.sleep(0.05)
            continue
        except PoolFullError:
            rep.refused_full += 1
            await asyncio.sleep(0.3)
            continue
        try:
            if rng.random() < 0.1:  # hangs up while queued or during prefill
                await asyncio.sleep(rng.uniform(0, 0.2))
                call.release()
                rep.released_early += 1
                continue
            try:
                await call.wait_live(timeout=rng.uniform(1.0, 6.0))
            except TimeoutError:
                call.release("cancelled")
                rep.released_early += 1
                continue
            rep.live_calls += 1
            talk_until = time.monotonic() + rng.uniform(0.5, 4.0)
            vanish = rng.random() < 0.15
            while time.monotonic() < talk_until:
                call.push_audio(frame)
                out = await call.next_output(0.12)
                if out is not None:
                    rep.frames_out += 1
                await asyncio.sleep(0.05)
            if vanish:  # the tab was closed: no hang-up, the pool must notice the silence
                rep.vanished += 1
                while call.state != CallState.ENDED:
                    try:
                        await call.next_output(0.5)
                    except CallEnded:
                        break
            else:
                call.release()
        except CallEnded as e:
            rep.end_reasons[e.reason] = rep.end_reasons.get(e.reason, 0) + 1
        except Exception as e:  # anything else is a defect the soak reports
            rep.unexpected_errors.append(f"{type(e).__name__}: {e}")
        if call.end_reason:
            rep.end_reasons[call.end_reason] = rep.end_reasons.get(call.end_reason, 0) + 1


async def run_soak(seconds: float, slots: int, callers: int, cache_dir: Path | None = None,
                   seed: int = 0) -> SoakReport:
    rep = SoakReport(seconds, slots, callers, rss_start_mb=rss_mb())
    runtime = build_runtime(RuntimeOptions(model="tiny", slots=slots, cache_dir=cache_dir))
    pool = SlotPool(runtime.engine, PoolConfig(idle_release_seconds=1.0, time_limit_seconds=20.0, max_queue=8))
    pool.start()
    try:
        rng = random.Random(seed)
        stop_at = time.monotonic() + seconds
        warm = asyncio.get_running_loop().call_later(min(10.0, seconds / 3), lambda: setattr(rep, "rss_warm_mb",
                                                                                            rss_mb()))
        await asyncio.gather(*[_caller(pool, runtime.engine.voice_names, random.Random(rng.random()), stop_at, rep)
                               for _ in range(callers)])
        warm.cancel()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pool.snapshot().slots_free < slots:
            await asyncio.sleep(0.1)
        m = pool.snapshot()
        rep.slots_free_at_end, rep.queue_at_end, rep.pool = m.slots_free, m.queue_length, m.as_dict()
    finally:
        pool.shutdown()
    rep.rss_end_mb = rss_mb()
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rep = asyncio.run(run_soak(a.seconds, a.slots, a.callers, a.cache_dir))
    text = json.dumps(asdict(rep) | {"clean": rep.clean}, indent=1)
    if a.json:
        a.json.write_text(text)
    logging.getLogger().warning("soak report:\n%s", text)
    return 0 if rep.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
