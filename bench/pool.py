"""SlotPool benchmark: server-added latency with N simulated callers on the real clock.

Each caller acquires a slot, then sends one 1920-sample frame every 80 ms (steady cadence, random
phase against the ticker) and reads every output, as the web handler does. Reported per slot
count: tick time, real-time factor, latency from frame pushed to matching output available, and
the server-added part of it (that latency minus the engine.step time of its tick), plus checks
that no slot leaked and that every caller got audio for every tick it was live.

    .venv/bin/python bench/pool.py                      # tiny model, 1/4/8 slots, 20 s each
    .venv/bin/python bench/pool.py --engine fake --fake-step-ms 30 --seconds 5

Results go to stdout as a markdown table and replace the "## SlotPool latency" section of
BENCHMARKS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from personaplex_demo.engine.pcm import SamplingParams, TickOutput  # noqa: E402
from personaplex_demo.serving.config import PoolConfig  # noqa: E402
from personaplex_demo.serving.metrics import PoolMetrics  # noqa: E402
from personaplex_demo.serving.pool import SlotPool  # noqa: E402
from personaplex_demo.serving.room import CallEnded  # noqa: E402

FRAME = 1920
TICK = 0.08
SECTION = "## SlotPool latency"
PERSONA = "You are a friendly assistant who answers briefly."

EngineFactory = Callable[[int], object]


class SleepEngine:
    """Stand-in engine whose step takes a fixed time: measures the pool alone."""

    frame_size = FRAME
    sample_rate = 24000
    max_persona_tokens = 512

    def __init__(self, batch_size: int, step_seconds: float) -> None:
        self.batch_size = batch_size
        self.step_seconds = step_seconds

    @property
    def voice_names(self) -> list[str]:
        return ["NATF0"]

    def validate_request(self, voice: str, persona: str, sampling: SamplingParams) -> None:
        pass

    def prefix_cached(self, voice: str, persona: str) -> bool:
        return True

    def start_session(self, slot: int, voice: str, persona: str, sampling: SamplingParams) -> None:
        pass

    def end_session(self, slot: int) -> None:
        pass

    def step(self, pcm: np.ndarray) -> TickOutput:
        time.sleep(self.step_seconds)
        return TickOutput(pcm=pcm * 0.5, text=[""] * self.batch_size)


def tiny_factory() -> EngineFactory:
    try:
        from bench.engines import build_engine
    except ImportError as exc:
        sys.exit(
            f"bench/pool.py: the tiny engine is not available ({exc}); "
            "bench/engines.py build_engine(model='tiny', slots=N) is needed. "
            "Run with --engine fake to measure the pool alone."
        )
    return lambda slots: build_engine(model="tiny", slots=slots)


def warm_up(engine, voice: str) -> None:
    """First steps pay for allocation and kernel selection; keep them out of the figures."""
    for slot in range(engine.batch_size):
        engine.start_session(slot, voice, PERSONA, SamplingParams())
    for _ in range(5):
        engine.step(np.zeros((engine.batch_size, FRAME), dtype=np.float32))
    for slot in range(engine.batch_size):
        engine.end_session(slot)


@dataclass
class Row:
    slots: int
    metrics: PoolMetrics
    every_tick: bool  # every caller got one output for every tick it was live
    leaked: int  # slots still held after every caller hung up
    outputs: int


async def caller(pool: SlotPool, voice: str, seconds: float, phase: float, rng: np.random.Generator):
    call = pool.admit(voice, PERSONA)
    await call.wait_live(timeout=60)
    ticks: list[int] = []

    async def read() -> None:
        try:
            while True:
                out = await call.next_output(1.0)
                if out is not None:
                    ticks.append(out.tick)
        except CallEnded:
            pass

    reader = asyncio.create_task(read())
    loop = asyncio.get_running_loop()
    await asyncio.sleep(phase)
    start = loop.time()
    k = 0
    while loop.time() - start < seconds:
        call.push_audio((rng.standard_normal(FRAME) * 0.01).astype(np.float32))
        k += 1
        await asyncio.sleep(max(0.0, start + k * TICK - loop.time()))
    call.release()
    await asyncio.wait_for(reader, 5)
    return call, ticks


def run_one(factory: EngineFactory, slots: int, seconds: float, seed: int) -> Row:
    engine = factory(slots)
    voice = engine.voice_names[0]
    warm_up(engine, voice)
    pool = SlotPool(engine, PoolConfig(time_limit_seconds=None, max_queue=0, admission="slots"))
    pool.start()
    rng = random.Random(seed)

    async def everyone():
        return await asyncio.gather(
            *(
                caller(pool, voice, seconds, rng.uniform(0, TICK), np.random.default_rng(seed + i))
                for i in range(slots)
            )
        )

    try:
        results = asyncio.run(everyone())
        metrics = pool.snapshot()  # before the slots are recycled, so `ticks` covers the calls
        deadline = time.monotonic() + 5
        while pool.snapshot().slots_free < slots and time.monotonic() < deadline:
            time.sleep(0.01)
        leaked = slots - pool.snapshot().slots_free
    finally:
        pool.shutdown()
    every_tick = all(
        ticks == list(range(ticks[0], ticks[0] + len(ticks))) and call.counters.output_drops == 0
        for call, ticks in results
        if ticks
    ) and all(ticks for _, ticks in results)
    return Row(slots, metrics, every_tick, leaked, sum(len(t) for _, t in results))


def table(rows: list[Row]) -> str:
    lines = [
        "| slots | ticks | tick p50 / p99 (ms) | RTF | latency p50 / p99 (ms) | server-added p50 / p99 (ms) "
        "| underruns | input / output drops | overruns | audio every live tick | slots leaked |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.slots} | {m.ticks} | {m.tick_p50_ms:.1f} / {m.tick_p99_ms:.1f} | {m.realtime_factor:.2f} "
            f"| {m.latency_p50_ms:.1f} / {m.latency_p99_ms:.1f} "
            f"| {m.added_latency_p50_ms:.1f} / {m.added_latency_p99_ms:.1f} "
            f"| {m.underruns} | {m.input_drops} / {m.output_drops} | {m.overruns} "
            f"| {'yes' if r.every_tick else 'NO'} | {r.leaked} |"
        )
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        rest = text[end + 1 :] if end >= 0 else ""
        text = text[:start] + body.rstrip("\n") + ("\n\n" + rest if rest else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["tiny", "fake"], default="tiny")
    ap.add_argument("--slots", default="1,4,8", help="comma-separated slot counts")
    ap.add_argument("--seconds", type=float, default=20.0, help="talk time per caller")
    ap.add_argument("--fake-step-ms", type=float, default=30.0, help="step time of --engine fake")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--benchmarks", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()

    if args.engine == "tiny":
        factory = tiny_factory()
        engine_desc = "tiny model (`build_engine(model='tiny', slots=N)`), CPU, float32"
    else:
        factory = lambda slots: SleepEngine(slots, args.fake_step_ms / 1e3)  # noqa: E731
        engine_desc = f"fake engine (step sleeps {args.fake_step_ms:g} ms; measures the pool alone)"

    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        print(f"{slots} slot(s): {args.seconds:g} s of {slots} caller(s)...", file=sys.stderr, flush=True)
        rows.append(run_one(factory, slots, args.seconds, args.seed))
    result = table(rows)
    print(result)

    command = "python bench/pool.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            SECTION,
            "",
            f"- Date: {datetime.date.today().isoformat()}",
            f"- Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
            f"- Engine: {engine_desc}",
            f"- Command: `{command.strip()}`",
            f"- Each caller sends one frame every 80 ms for {args.seconds:g} s (random phase against the "
            "ticker) and reads every output. Latency: frame pushed to its output frame available; "
            "server-added: the same minus the engine.step time of that tick (it includes the wait for the "
            "next tick: the tick's phase follows the callers (serving/pacing.py `PhaseAligner`), so one "
            "caller waits a few ms, while callers whose whole 80 ms frames arrive at random phases keep "
            "their spread, 0-80 ms; a browser's 40 ms packets halve it). Goal: server-added at most 60 ms "
            "p50 and 120 ms p99 (docs/serving.md § Pacing).",
            "",
            result,
            "",
        ]
    )
    if not args.no_write:
        write_section(args.benchmarks, body)
        print(f"wrote the '{SECTION}' section of {args.benchmarks}", file=sys.stderr)


if __name__ == "__main__":
    main()
