"""The Realtime API beside the page: one caller at a time through each door, the app as a user
starts it (`python app.py --model tiny`, one torch thread), each door with an app of its own so
that the pool's latency window holds that door's frames only.

- Realtime: the official `openai` SDK opens a socket, sends `session.update` with a voice and a
  persona, and streams speech (espeak-ng) in real time. Times from `session.update`: the
  `session.updated` answer, `personaplex.live`, and the first agent audio delta.
- Page: an aiortc peer that drives the page's Gradio events (tests/callers.py `PageCaller`),
  sending a tone. Time from the offer to the first audible agent frame.

For both, over `--seconds` of live call: the agent audio received per wall second, the longest gap
between two arrivals, and the pool's frame latency (a frame pushed into the room to its agent frame
ready; "added" is that minus the engine step) from /api/status. Round 1 of each door is a cold
prompt (no prefix cache); later rounds reuse it.

    python bench/realtime.py [--rounds 3] [--seconds 10] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, md_table, replace_section  # noqa: E402
from bench.media import App  # noqa: E402
from tests.callers import PageCaller, PageConfig  # noqa: E402
from tests.sdk_callers import SdkCaller, speech_pcm  # noqa: E402

log = logging.getLogger("bench.realtime")
PERSONA = "You are a wise and friendly teacher."


def longest_gap(arrivals: list[float]) -> float:
    return float(max(np.diff(arrivals))) if len(arrivals) > 1 else float("nan")


async def socket_round(app: App, speech: np.ndarray, seconds: float, seed: int) -> dict:
    async with SdkCaller(app.base, None) as caller:
        await caller.wait_event("session.created")
        sent = time.monotonic()
        await caller.configure("NATF2", PERSONA, seed=seed)
        updated = await caller.wait_event("session.updated")
        updated_at = next(at for at, e in caller.events if e is updated)
        await caller.wait_live(60)
        talking = asyncio.create_task(caller.stream(np.tile(speech, int(seconds * 24000 // speech.size) + 2)))
        await caller.wait_for(lambda: caller.audio, 30, "the first audio delta")
        first = caller.audio[0][0]
        await asyncio.sleep(seconds)
        talking.cancel()
        window = (first + 1.0, first + seconds)
        arrivals = [at for at, _ in caller.audio if window[0] <= at <= window[1]]
        return {"updated": updated_at - sent, "live": caller.live_at - sent, "first": first - sent,
                "audio": caller.audio_seconds(*window) / (window[1] - window[0]), "gap": longest_gap(arrivals)}


async def page_round(app: App, seconds: float, seed: int) -> dict:
    async with httpx.AsyncClient(base_url=app.base, timeout=30) as http:
        caller = PageCaller(http, await PageConfig.fetch(http), "NATF2", PERSONA, seed=seed)
        arrivals: list[float] = []
        sent = time.monotonic()
        await caller.offer(220.0)
        deadline = time.monotonic() + 60
        while caller.energy == 0.0:
            assert time.monotonic() < deadline, "no agent audio on the page"
            await asyncio.sleep(0.005)
        first = time.monotonic()
        end = first + seconds
        samples_at_start = None
        while time.monotonic() < end:
            before = caller.samples
            await asyncio.sleep(0.005)
            if caller.samples != before:
                arrivals.append(time.monotonic())
            if samples_at_start is None and time.monotonic() >= first + 1.0:
                samples_at_start = caller.samples
        heard = (caller.samples - (samples_at_start or 0)) / 48000
        await caller.hang_up()
        return {"first": first - sent, "audio": heard / (seconds - 1.0),
                "gap": longest_gap([a for a in arrivals if a >= first + 1.0])}


def median(rows: list[dict], key: str, start: int = 0) -> float:
    values = [r[key] for r in rows[start:] if key in r and r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


async def measure(rounds: int, seconds: float) -> dict[str, dict]:
    speech = speech_pcm(Path(tempfile.mkdtemp(prefix="realtime-bench-")))
    results: dict[str, dict] = {}
    for door in ("realtime", "page"):
        app = App(slots=4, extra=[], cache_dir=None)
        try:
            rows = []
            for r in range(rounds):
                row = (await socket_round(app, speech, seconds, seed=r) if door == "realtime"
                       else await page_round(app, seconds, seed=r))
                log.info("%s round %d: %s", door, r + 1, {k: round(v, 3) for k, v in row.items()})
                rows.append(row)
                await asyncio.sleep(1.5)  # the slot is freed and the room empty again
            status = app.status()
            results[door] = {"rows": rows, "status": status}
        finally:
            app.close()
    return results


def report(results: dict[str, dict], rounds: int, seconds: float) -> str:
    def ms(v: float) -> str:
        return "-" if v != v else f"{v * 1e3:.0f} ms"

    table = []
    for door, label in (("realtime", "Realtime API (openai SDK)"), ("page", "page (aiortc, Gradio events)")):
        rows, s = results[door]["rows"], results[door]["status"]
        table.append([label, ms(rows[0]["first"]), ms(median(rows, "first", 1)),
                      ms(median(rows, "updated")) if door == "realtime" else "-",
                      ms(median(rows, "live", 1)) if door == "realtime" else "-",
                      f"{median(rows, 'audio'):.2f}", ms(max(r["gap"] for r in rows)),
                      f"{s['latency_p50_ms']:.0f} / {s['latency_p99_ms']:.0f} ms",
                      f"{s['added_latency_p50_ms']:.0f} / {s['added_latency_p99_ms']:.0f} ms"])
    headers = ["door", "first audio, cold", "first audio, cached", "session.updated", "live", "audio per s",
               "longest gap", "frame latency p50 / p99", "added p50 / p99"]
    return (md_table(headers, table) + f"\n\n{rounds} rounds of {seconds:g} s per door, one caller at a time, "
            "4 slots. \"First audio\" is from `session.update` (Realtime) or the offer (page) to the first agent "
            "audio the client holds; \"cold\" is round 1, \"cached\" the median of the rest. \"Audio per s\" counts "
            "agent audio received per wall second after the first second (medians); the frame latency is the pool's "
            "(/api/status) over every frame of that door's rounds.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--write", action="store_true", help="rewrite its section of BENCHMARKS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log.info("load before: %s", loadavg())
    results = asyncio.run(measure(args.rounds, args.seconds))
    body = report(results, args.rounds, args.seconds)
    print(body)
    if args.write:
        replace_section("The Realtime API beside the page", body, extra=f"load average before: {loadavg()}")


if __name__ == "__main__":
    main()
