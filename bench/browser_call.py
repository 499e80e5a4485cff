"""A call as a person meets it, in Debian's Chromium against the app as a user starts it.

1. Time to first audio: from the click on Record to the first agent sound the page plays (the
   first 5 ms block of received audio above -40 dBFS, read from the received track in the page),
   for a (voice, persona) the room has not prefilled yet ("cold") and then for the same one
   again ("cached"). Each is split into what the page measures (the microphone and the offer, the
   offer's answer, ICE and DTLS, then the wait for sound) and what the server measures for the
   same call (its log line "first sound ... after the offer": connect, inputs, room, first tick,
   first sound; web/call_figures.py). "Network and playout" is what is left of the total once the
   page's share before the offer and the server's share are taken out.
2. Round trip through the browser: the app runs a loopback engine (bench/loopback_app.py: each
   caller hears their own microphone one step after the room took it, the engine's own causal
   delay), the page's microphone is a click a second, and both the clicks it sends and those that
   come back are read with MediaStreamTrackProcessor (no Web Audio FIFO; tests/browser_support.py
   `CLICK_ROUND_TRIP`). Several calls per case, embedded and with media workers; p50, p95, the
   slope of the round trip over each call, and the overhead: the round trip less the model's floor
   (160 ms: a sound at a frame's start is answered when the next frame is complete) and the tick's
   compute. `--before DIR` runs the same cases against another checkout of the app (its own
   loopback engine and floor), interleaved with this one, so both are measured in one run.

    python bench/browser_call.py [--runs 3] [--calls 6] [--seconds 20] [--before DIR] [--write]
"""

from __future__ import annotations

import argparse
import logging
import re
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import md_table, replace_section  # noqa: E402
from tests.browser_support import (  # noqa: E402
    CALL_TIMING,
    CLICK_ROUND_TRIP,
    RECORD_PCS,
    chromium,
    click_trips,
    launched_app,
    make_mic_wav,
    start_call,
    stop_call,
    wait_for,
)

log = logging.getLogger("bench.browser_call")
ROOT = Path(__file__).resolve().parent.parent
# Chromium's own jitter buffer for the received audio: its mean delay so far.
JITTER_BUFFER_MS = """
async () => {
  let ms = 0;
  (await window.__pcs.at(-1).getStats()).forEach(r => {
    if (r.type === "inbound-rtp" && r.kind === "audio" && r.jitterBufferEmittedCount)
      ms = 1e3 * r.jitterBufferDelay / r.jitterBufferEmittedCount;
  });
  return ms;
}
"""
FIRST_SOUND = re.compile(r"call (\w+): first sound ([\d.]+) s after the offer \((.*)\)")
PAGE_PARTS = (("click", "offer_sent", "page: microphone, offer"), ("offer_sent", "answer", "offer -> answer"),
              ("answer", "connected", "ICE + DTLS"), ("connected", "first_sound", "connected -> first sound"))


def server_parts(log_text: str) -> list[tuple[float, dict[str, float]]]:
    """Each call's server-side time to first sound and its parts, in the order of the log."""
    found = []
    for m in FIRST_SOUND.finditer(log_text):
        parts = {k: float(v) for k, v in (p.split() for p in m.group(3).split(", "))}
        found.append((float(m.group(2)), parts))
    return found


def one_first_audio(ctx, url: str, app) -> dict[str, float]:
    """One call from the click to its first sound; the page's marks (ms), then hang up."""
    page = ctx.new_page()
    page.add_init_script(RECORD_PCS)
    page.add_init_script(CALL_TIMING)
    page.goto(url, wait_until="networkidle")
    start_call(page, timeout_ms=30_000)
    page.wait_for_function("window.__t.first_sound !== undefined", timeout=30_000)
    marks = page.evaluate("window.__t")
    stop_call(page)
    wait_for(lambda: app.status()["slots_free"] == app.status()["slots_total"], 10, "the slot freed")
    page.close()
    return marks


def first_audio(runs: int, mic_wav: Path, work: Path, cache_dir: Path) -> list[dict]:
    persona = f"You are Lin, who answers briefly about trains. Visitor {secrets.token_hex(4)}."
    rows = []
    with launched_app(work / "app-first", cache_dir, args=["--slots", "2"]) as app, \
            chromium(work / "udd-first", mic_wav) as ctx:
        url = f"{app.base_url}/?voice=NATF2&persona={quote(persona)}"
        for run in range(runs + 1):
            marks = one_first_audio(ctx, url, app)
            time.sleep(1.0)
            total = (marks["first_sound"] - marks["click"]) / 1e3
            rows.append({"case": "cold" if run == 0 else "cached", "total": total,
                         "page": {label: (marks[b] - marks[a]) / 1e3 for a, b, label in PAGE_PARTS},
                         "before_offer": (marks["offer_sent"] - marks["click"]) / 1e3})
            log.info("%s: %.3f s from the click to the first sound", rows[-1]["case"], total)
        for row, (server, parts) in zip(rows, server_parts(app.log_text()), strict=True):
            row["server"], row["server_parts"] = server, parts
            row["network"] = row["total"] - row["before_offer"] - server
    return rows


def loopback_floor_ms(root: Path) -> float:
    """The round-trip floor of `root`'s loopback engine: its answer comes LOOPBACK_FRAMES steps
    after the tick that took a frame, and a sound at the frame's start waits a frame for that tick."""
    frames = int(re.search(r"^LOOPBACK_FRAMES = (\d+)", (root / "bench" / "loopback_app.py").read_text(), re.M)[1])
    return 80.0 * (frames + 1)


def one_round_trip_call(ctx, app, seconds: float) -> dict:
    page = ctx.new_page()
    for script in (RECORD_PCS, CALL_TIMING, CLICK_ROUND_TRIP):
        page.add_init_script(script)
    page.goto(app.base_url + "/", wait_until="networkidle")
    if not page.evaluate("window.__trackProcessor"):
        raise SystemExit("this Chromium has no MediaStreamTrackProcessor: the round trip cannot be read")
    start_call(page, timeout_ms=30_000)
    page.wait_for_function("document.querySelector('#status-line').innerText.startsWith('Live')", timeout=30_000)
    page.wait_for_timeout(int(seconds * 1000))
    sent, back = page.evaluate("window.__clickSent()"), page.evaluate("window.__clickBack")
    jitter = page.evaluate(JITTER_BUFFER_MS)
    status = app.status()
    stop_call(page)
    wait_for(lambda: app.status()["slots_free"] == app.status()["slots_total"], 10, "the slot freed")
    page.close()
    sent = [c for c in sent if c < max(back, default=0.0) - 1000.0]  # clicks that had time to come back
    trips = click_trips(sent, back)
    heard_from = next((i for i, c in enumerate(sent) if click_trips([c], back)), len(sent))
    slope = float(np.polyfit([c / 1e3 for c, _ in trips], [t for _, t in trips], 1)[0]) if len(trips) > 3 else 0.0
    return {"trips": [t for _, t in trips], "sent": len(sent) - heard_from, "slope": slope,
            "room_ms": status["latency_p50_ms"], "tick_ms": status["tick_p50_ms"], "browser_jitter_ms": jitter}


def round_trip(code: str, root: Path, mode: str, calls: int, seconds: float, mic_wav: Path, work: Path,
               cache_dir: Path) -> dict:
    args = ["--slots", "2"] + (["--media-workers", "2"] if mode == "media workers" else [])
    name = f"{code}-{mode}".replace(" ", "-")
    with launched_app(work / f"app-{name}", cache_dir, args=args, entry=str(root / "bench" / "loopback_app.py")) \
            as app, chromium(work / f"udd-{name}", mic_wav) as ctx:
        results = [one_round_trip_call(ctx, app, seconds) for _ in range(calls)]
    trips = np.array([t for r in results for t in r["trips"]])
    row = {"code": code, "mode": mode, "calls": calls, "trips": trips, "floor_ms": loopback_floor_ms(root),
           "sent": sum(r["sent"] for r in results), "slopes": [r["slope"] for r in results]}
    for key in ("room_ms", "tick_ms", "browser_jitter_ms"):
        row[key] = float(np.median([r[key] for r in results]))
    log.info("%s, %s: round trip p50 %.0f ms over %d clicks", code, mode,
             float(np.median(trips)) if trips.size else float("nan"), trips.size)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="cached calls after the cold one")
    ap.add_argument("--calls", type=int, default=6, help="calls per round-trip case")
    ap.add_argument("--seconds", type=float, default=20.0, help="of clicks per round-trip call")
    ap.add_argument("--before", type=Path, help="another checkout of the app, measured in the same run")
    ap.add_argument("--long", type=float, default=0.0, metavar="SECONDS",
                    help="instead, one call this long (embedded): the round trip over it, minute by minute")
    ap.add_argument("--modes", nargs="+", default=["embedded", "media workers"], choices=["embedded", "media workers"],
                    help="media paths of the round trip")
    ap.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.long:
        return long_call(a.long, a.write)
    codes = [("before", a.before.resolve())] if a.before else []
    codes.append(("this", ROOT))
    with tempfile.TemporaryDirectory(prefix="browser-call-") as tmp:
        work = Path(tmp)
        cache_dir = work / "hf"
        mic_wav = make_mic_wav(work)
        rows = first_audio(a.runs, mic_wav, work, cache_dir)
        loops = [round_trip(code, root, mode, a.calls, a.seconds, mic_wav, work, cache_dir)
                 for mode in a.modes for code, root in codes]
    body = report(rows, loops)
    print(body)
    if a.write:
        replace_section("A call in the browser: time to first audio and the round trip", body)
    return 0


def long_call(seconds: float, write: bool) -> int:
    """One long call through the loopback engine: whether the round trip grows over it."""
    with tempfile.TemporaryDirectory(prefix="browser-call-") as tmp:
        work = Path(tmp)
        r = round_trip("this", ROOT, "embedded", 1, seconds, make_mic_wav(work), work, work / "hf")
    trips, minute = r["trips"], 60
    rows = [[f"{k + 1}", len(part), f"{np.median(part):.0f}", f"{np.percentile(part, 95):.0f}"]
            for k, part in enumerate(np.array_split(trips, max(1, round(len(trips) / minute))))]
    body = (md_table(["minute", "clicks back", "round trip p50 (ms)", "p95 (ms)"], rows) +
            f"\n\nOne call of {seconds:.0f} s, embedded, loopback engine: {len(trips)} clicks back of {r['sent']} sent; "
            f"the round trip's slope over the call {r['slopes'][0]:+.3f} ms per second (goal: at most 0.2); "
            f"model floor {r['floor_ms']:.0f} ms, tick p50 {r['tick_ms']:.0f} ms, room latency p50 "
            f"{r['room_ms']:.0f} ms, Chromium jitter buffer {r['browser_jitter_ms']:.0f} ms at the end.\n")
    print(body)
    if write:
        replace_section("A long call in the browser: the round trip over minutes", body)
    return 0


def report(rows: list[dict], loops: list[dict]) -> str:
    def median(case: str, get) -> float:
        return statistics.median(get(r) for r in rows if r["case"] == case)

    page_labels = [label for _, _, label in PAGE_PARTS]
    server_labels = list(rows[0]["server_parts"])
    table = []
    for case in ("cold", "cached"):
        n = sum(r["case"] == case for r in rows)
        table.append([f"{case} ({n} call{'s' if n > 1 else ''})", f"{median(case, lambda r: r['total']):.2f}",
                      *(f"{1e3 * median(case, lambda r, k=k: r['page'][k]):.0f}" for k in page_labels),
                      f"{median(case, lambda r: r['server']) * 1e3:.0f}",
                      *(f"{1e3 * median(case, lambda r, k=k: r['server_parts'].get(k, 0.0)):.0f}"
                        for k in server_labels),
                      f"{1e3 * median(case, lambda r: r['network']):.0f}"])
    first = md_table(["case (median)", "click -> first sound (s)", *(f"{k} (ms)" for k in page_labels),
                      "server: offer -> first sound (ms)", *(f"server: {k} (ms)" for k in server_labels),
                      "network and playout (ms)"], table)
    loop_rows = []
    for r in loops:
        if not len(r["trips"]):
            loop_rows.append([r["code"], r["mode"], r["calls"], 0, r["sent"], *["-"] * 9])
            continue
        p50 = float(np.median(r["trips"]))
        overhead = p50 - r["floor_ms"] - r["tick_ms"]
        loop_rows.append([r["code"], r["mode"], r["calls"], len(r["trips"]), r["sent"], f"{p50:.0f}",
                          f"{np.percentile(r['trips'], 95):.0f}", f"{statistics.median(r['slopes']):+.2f}",
                          f"{max(r['slopes'], key=abs):+.2f}", f"{r['floor_ms']:.0f}", f"{r['tick_ms']:.0f}",
                          f"{overhead:.0f}", f"{r['room_ms']:.0f}", f"{r['browser_jitter_ms']:.0f}"])
    loop = md_table(["code", "media path", "calls", "clicks back", "of clicks sent", "round trip p50 (ms)", "p95 (ms)",
                     "slope, median (ms/s)", "slope, largest (ms/s)", "model floor (ms)", "tick p50 (ms)",
                     "overhead p50 (ms)", "room latency p50 (ms)", "Chromium jitter buffer (ms)"], loop_rows)
    cached_total, cached_server = median("cached", lambda r: r["total"]), median("cached", lambda r: r["server"])
    reading = (f"For a cached (voice, persona) the first sound plays {cached_total:.2f} s after the click "
               f"(goal: under 1 s), of which the server's share, from the offer to the first audible frame "
               f"sent, is {1e3 * cached_server:.0f} ms (goal: under 300 ms). The server's parts overlap the "
               "page's: its `connect` is the page's offer, answer and ICE + DTLS, seen from the other side. "
               "`first_tick` is one step plus the wait for it: in an empty room, as here, the tick that "
               "prefilled stepped nobody and keeps no schedule, so the next comes 20 ms later; a caller "
               "joining a busy room waits for the room's next tick (up to 80 ms). Round trip: the clicks the page's "
               "microphone sends and those that come back, both read with MediaStreamTrackProcessor; the model "
               "floor is the loopback engine's answer (one step after the tick that took the frame, the "
               "engine's own causal delay: docs/engine.md § Causal delay) plus the frame's own 80 ms; the "
               "overhead is the round trip less that floor and the tick's compute: what the serving path and "
               "the browser add. `before` is the app as it was before the latency budget of docs/serving.md, "
               "whose loopback answered one step later (a 240 ms floor); its overhead is measured against its "
               "own floor.")
    return (f"### Time to first audio\n\n{first}\n\n### Round trip through the browser (loopback engine)\n\n"
            f"{loop}\n\n{reading}\n")


if __name__ == "__main__":
    sys.exit(main())
