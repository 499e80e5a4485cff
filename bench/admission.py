"""A room fuller than the host can carry: admission by measured headroom beside admission by slot count.

For each `--admission` mode this starts `python app.py --model tiny --slots N` (as bench/media.py
does, with a queue) and connects N real WebRTC callers (bench/media.py's `PageCaller`: aiortc
peers that drive the page's own Gradio events), one every 0.3 s. Once the room has settled (no
caller went live for `--settle` seconds), it measures `--seconds` and sorts every caller into:

- live: at least 0.98 s of agent audio per second and no gap over 250 ms;
- waiting: no agent audio, and the page's status line names its place in the queue and why;
- in between: anything else (audio that comes and goes): what admission exists to prevent.

Then it hangs up one live caller and times how long until a waiting one hears the agent.

    python bench/admission.py --slots 12 --seconds 20 [--write]
    python bench/admission.py --modes headroom --runs 3 --compare DIR   (three runs in a row, here and at DIR)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import media  # noqa: E402
from bench.common import md_table, publish  # noqa: E402

log = logging.getLogger("bench.admission")
FULLY_LIVE_AUDIO = 0.98  # s of agent audio per wall second
LONGEST_GAP = 0.25  # s
SECTION = "A room fuller than the host: admission by headroom"


class WatchedCaller(media.PageCaller):
    """A page caller that also keeps the last status line the page was sent."""

    status = ""

    def seen(self, msg: dict) -> None:
        if msg.get("msg") == "process_generating":
            for item in json.dumps(msg.get("output", {})).split('"'):
                if " in the queue" in item or item.startswith(("Live", "Preparing")):
                    self.status = item


@dataclass
class Outcome:
    mode: str
    callers: int
    live: int
    waiting: int  # with the reason on the page
    between: int
    live_audio_min: float
    audio_range: str  # min-max of every caller's agent audio per second
    live_gap_max_ms: float
    gap_max_ms: float  # of every caller that heard the agent at all
    tick_p50: float
    tick_p99: float
    held_back: int
    shed: int
    next_in_s: float  # after a live caller hung up, until a waiting one heard the agent (nan: nobody waited)
    reasons: str


def sort(caller: WatchedCaller, seconds: float) -> str:
    r = caller.result
    if r.audio_s / seconds >= FULLY_LIVE_AUDIO and r.longest_gap_s <= LONGEST_GAP:
        return "live"
    if r.audio_s == 0 and " in the queue" in caller.status:
        return "waiting"
    return "between"


async def run(app: media.App, n: int, seconds: float, settle: float, mode: str) -> Outcome:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(app.base + "/config") as r:
            events = media.PageEvents.from_config(await r.json())
        callers = [WatchedCaller(http, app.base, events, i) for i in range(n)]
        for c in callers:
            await c.start()
            await asyncio.sleep(0.3)
        live, quiet_since, deadline = -1, time.monotonic(), time.monotonic() + 90
        while time.monotonic() - quiet_since < settle and time.monotonic() < deadline:
            figures = app.status()
            now_live = figures["slots_live"]
            log.info("live %d, queue %d, tick p50 %.0f p99 %.0f ms, headroom %.0f ms, media lag %.0f ms, shed %d",
                     now_live, figures["queue_length"], figures["tick_p50_ms"], figures["tick_p99_ms"],
                     figures["headroom_ms"], figures["media_lag_ms"], figures["calls_ended"].get("overloaded", 0))
            if now_live != live:
                live, quiet_since = now_live, time.monotonic()
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        for c in callers:
            c.window = (t0, t0 + seconds)
        await asyncio.sleep(seconds)
        status = app.status()
        kinds = [sort(c, seconds) for c in callers]
        every = [c.result.audio_s / seconds for c in callers]
        gap_all = 1e3 * max(c.result.longest_gap_s for c in callers)
        live_ones = [c for c, k in zip(callers, kinds, strict=True) if k == "live"]
        waiting = [c for c, k in zip(callers, kinds, strict=True) if k == "waiting"]
        reasons = sorted({c.status.split(":")[0] for c in waiting})
        next_in = float("nan")
        if live_ones and waiting:
            for c in waiting:
                c.window, c.result.audio_s = (time.monotonic(), float("inf")), 0.0
            await live_ones[0].stop()
            hung_up = time.monotonic()
            while time.monotonic() - hung_up < 20 and not any(c.result.audio_s > 0.5 for c in waiting):
                await asyncio.sleep(0.1)
            if any(c.result.audio_s > 0.5 for c in waiting):
                next_in = time.monotonic() - hung_up
        for c in callers:
            if c is not (live_ones[0] if live_ones and waiting else None):
                await c.stop()
    audio = [c.result.audio_s / seconds for c in live_ones] if live_ones else [0.0]
    gaps = [c.result.longest_gap_s for c in live_ones] if live_ones else [0.0]
    return Outcome(mode, n, len(live_ones), len(waiting), kinds.count("between"), min(audio),
                   f"{min(every):.2f}-{max(every):.2f}", 1e3 * max(gaps), gap_all,
                   status["tick_p50_ms"], status["tick_p99_ms"], status.get("calls_held_back", 0),
                   status["calls_ended"].get("overloaded", 0), next_in, "; ".join(reasons))


def table(rows: list[Outcome]) -> str:
    head = ["admission", "callers", "fully live", "waiting, reason shown", "in between", "audio s/s (all callers)",
            "audio s/s (live, min)", "longest gap (live / all)", "tick p50 / p99", "held back", "shed",
            "hang-up -> next caller live"]
    body = [[r.mode, r.callers, r.live, f"{r.waiting} ({r.reasons})" if r.waiting else "0", r.between,
             r.audio_range, f"{r.live_audio_min:.2f}" if r.live else "-",
             f"{r.live_gap_max_ms:.0f} / {r.gap_max_ms:.0f} ms", f"{r.tick_p50:.0f} / {r.tick_p99:.0f} ms",
             r.held_back, r.shed, "-" if r.next_in_s != r.next_in_s else f"{r.next_in_s:.1f} s"] for r in rows]
    return md_table(head, body)


def reading(rows: list[Outcome]) -> str:
    lines = [f"Fully live: at least {FULLY_LIVE_AUDIO} s of agent audio per second and no gap over "
             f"{LONGEST_GAP * 1e3:.0f} ms in the window; waiting: no agent audio, the page's status line showing "
             "the place in the queue and the reason; in between: anything else. Every caller speaks all along "
             "(a tone, two seconds on and one off), queued or not."]
    for r in rows:
        line = (f"- {r.mode}: {r.live} of {r.callers} fully live, {r.waiting} waiting with the reason shown, "
                f"{r.between} in between (agent audio {r.audio_range} s/s across all callers)")
        if r.next_in_s == r.next_in_s:
            line += f"; after a live caller hung up, a waiting one heard the agent {r.next_in_s:.1f} s later"
        lines.append(line + ".")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=12, help="slots, and as many callers")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window, once the room has settled")
    ap.add_argument("--settle", type=float, default=6.0, help="seconds without a new live call that count as settled")
    ap.add_argument("--modes", nargs="+", default=["headroom", "slots"], choices=["headroom", "slots"])
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--runs", type=int, default=1, help="runs of each mode, in a row")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="also run app.py from another checkout (a git worktree of an older commit), before each run here")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    media.SpeechLikeTrack = media.make_track_class()
    rows = []
    checkouts = [("", media.REPO)]
    if a.compare:
        other = Path(a.compare).resolve()
        commit = subprocess.run(["git", "-C", str(other), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or other.name
        checkouts.insert(0, (f", at {commit}", other))
    for _ in range(a.runs):
        for mode in a.modes:
            for label, repo in checkouts:
                app = media.App(a.slots, ["--max-queue", "32", "--admission", mode], a.cache_dir, repo)
                try:
                    rows.append(asyncio.run(media.with_loopback(run(app, a.slots, a.seconds, a.settle, mode))))
                finally:
                    app.close()
                rows[-1].mode += label
                log.info("\n%s", table(rows[-1:]))
    publish(SECTION, table(rows) + "\n\n" + reading(rows), a.write)


if __name__ == "__main__":
    main()
