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
   caller hears their own microphone 160 ms after the room got it, the model's own delay), the
   page's microphone is a click a second, and the page notes when each click comes back. Embedded
   and with media workers; median and p95 against the 160 ms floor.

    python bench/browser_call.py [--runs 3] [--seconds 20] [--write]
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
from personaplex_demo.rtc.audio import PREFETCH_MS  # noqa: E402
from tests.browser_support import (  # noqa: E402
    CALL_TIMING,
    CLICK_MICROPHONE,
    RECORD_PCS,
    chromium,
    launched_app,
    make_mic_wav,
    round_trips,
    start_call,
    stop_call,
    wait_for,
)

log = logging.getLogger("bench.browser_call")
FLOOR_MS = 160.0  # the model's own delay between hearing and answering (two frames)
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


def round_trip(mode: str, seconds: float, mic_wav: Path, work: Path, cache_dir: Path) -> dict:
    args = ["--slots", "2"] + (["--media-workers", "2"] if mode == "media workers" else [])
    with launched_app(work / f"app-loop-{mode.replace(' ', '-')}", cache_dir, args=args,
                      entry="bench/loopback_app.py") as app, chromium(work / f"udd-{mode}", mic_wav) as ctx:
        page = ctx.new_page()
        for script in (RECORD_PCS, CALL_TIMING, CLICK_MICROPHONE):
            page.add_init_script(script)
        page.goto(app.base_url + "/", wait_until="networkidle")
        start_call(page, timeout_ms=30_000)
        page.wait_for_function("document.querySelector('#status-line').innerText.startsWith('Live')", timeout=30_000)
        page.wait_for_timeout(int(seconds * 1000))
        clicks, onsets = page.evaluate("window.__clicks"), page.evaluate("window.__onsets")
        self_onsets = page.evaluate("window.__selfOnsets")
        jitter = page.evaluate(JITTER_BUFFER_MS)
        room = app.status()["latency_p50_ms"]
        stop_call(page)
    now = max(onsets) if onsets else 0.0
    sent = [c for c in clicks if c < now - 1.0]
    trips = np.array(round_trips(sent, onsets)) * 1e3
    heard_from = next((i for i, c in enumerate(sent) if round_trips([c], onsets)), len(sent))
    own = np.array(round_trips(sent, self_onsets, longest=0.2)) * 1e3
    return {"mode": mode, "trips": trips, "sent": len(sent) - heard_from, "room_ms": room,
            "own_ms": float(np.median(own)) if len(own) else 0.0, "browser_jitter_ms": jitter}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="cached calls after the cold one")
    ap.add_argument("--seconds", type=float, default=20.0, help="of clicks per round-trip case")
    ap.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="browser-call-") as tmp:
        work = Path(tmp)
        cache_dir = work / "hf"
        mic_wav = make_mic_wav(work)
        rows = first_audio(a.runs, mic_wav, work, cache_dir)
        loops = [round_trip(mode, a.seconds, mic_wav, work, cache_dir) for mode in ("embedded", "media workers")]
    body = report(rows, loops)
    print(body)
    if a.write:
        replace_section("A call in the browser: time to first audio and the round trip", body)
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
            loop_rows.append([r["mode"], 0, r["sent"], *["-"] * 7])
            continue
        p50 = float(np.median(r["trips"]))
        rest = p50 - r["own_ms"] - FLOOR_MS - r["room_ms"] - PREFETCH_MS - r["browser_jitter_ms"]
        loop_rows.append([r["mode"], len(r["trips"]), r["sent"], f"{p50:.0f}", f"{np.percentile(r['trips'], 95):.0f}",
                          f"{r['own_ms']:.0f}", f"{r['room_ms']:.0f}", PREFETCH_MS,
                          f"{r['browser_jitter_ms']:.0f}", f"{rest:.0f}"])
    loop = md_table(["media path", "clicks back", "of clicks sent", "round trip p50 (ms)", "p95 (ms)",
                     "the measurement's own (ms)", "room latency p50 (ms)", "server jitter buffer (ms)",
                     "Chromium jitter buffer (ms)", "the rest (ms)"], loop_rows)
    cached_total, cached_server = median("cached", lambda r: r["total"]), median("cached", lambda r: r["server"])
    reading = (f"For a cached (voice, persona) the first sound plays {cached_total:.2f} s after the click "
               f"(goal: under 1 s), of which the server's share, from the offer to the first audible frame "
               f"sent, is {1e3 * cached_server:.0f} ms (goal: under 300 ms). The server's parts overlap the "
               "page's: its `connect` is the page's offer, answer and ICE + DTLS, seen from the other side. "
               "`first_tick` is one step plus the wait for it: in an empty room, as here, the tick that "
               "prefilled stepped nobody and keeps no schedule, so the next comes 20 ms later; a caller "
               "joining a busy room waits for the room's next tick (up to 80 ms). Round trip: a click goes out "
               "in the page's 40 ms packets, waits in the "
               "server's jitter buffer, waits for the tick that takes it (the room latency), comes back "
               "160 ms later (the floor, the model's own delay), is paced out and waits in Chromium's "
               "jitter buffer; \"the rest\" is what the page's capture, encoding, playout and Web Audio add, "
               "which the page cannot split further.")
    return (f"### Time to first audio\n\n{first}\n\n### Round trip through the browser (loopback engine)\n\n"
            f"{loop}\n\n{reading}\n")


if __name__ == "__main__":
    sys.exit(main())
