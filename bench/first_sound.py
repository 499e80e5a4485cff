"""First sound after Record, in Chromium and in Firefox, side by side against the same app.

For each version of the app (this checkout, and `--before DIR` if given), this starts it as a user
does (default topology, tiny model, `--slots 2`) and places `--calls` calls from each browser in
turn, through the page's own buttons: Debian's Chromium driven by Playwright, Debian's firefox-esr
over WebDriver BiDi (tests/firefox.py), each with its fake microphone. A first call warms the room
up (the persona's prefill) and is not counted. Per call, from the page's own marks
(tests/browser_support.py CALL_TIMING and FIRST_AUDIBLE): the click on Record to the peer
connection connected, and to the first audible agent packet the browser received (the audio level
the server sends with each packet, as the browser reports it: the same reading in both browsers,
and one a headless Firefox, which has no sound device, can give). Chromium's first sound played
(Web Audio) is shown beside it.

    python bench/first_sound.py [--calls 5] [--before DIR] [--write]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import md_table, replace_section  # noqa: E402
from tests.browser_support import (  # noqa: E402
    CALL_TIMING,
    FIRST_AUDIBLE,
    RECORD_PCS,
    ROOT,
    chromium,
    launched_app,
    make_mic_wav,
    start_call,
    stop_call,
    wait_for,
)
from tests.firefox import RECORD, firefox  # noqa: E402

log = logging.getLogger("bench.first_sound")
WAIT_SECONDS = 20.0  # for a call's first audible packet


def slot_freed(app) -> None:
    wait_for(lambda: app.status()["slots_free"] == app.status()["slots_total"], 10, "the slot freed")


def chromium_call(ctx, app) -> dict:
    page = ctx.new_page()
    for script in (RECORD_PCS, CALL_TIMING, FIRST_AUDIBLE):
        page.add_init_script(script)
    page.goto(app.base_url + "/", wait_until="networkidle")
    start_call(page, timeout_ms=30_000)
    page.wait_for_function("window.__t.first_audible !== undefined && window.__t.first_sound !== undefined",
                           timeout=30_000)
    marks = page.evaluate("window.__t")
    stop_call(page)
    slot_freed(app)
    page.close()
    return marks


def firefox_call(ff, app) -> dict:
    """The call's marks; without `first_audible` if no agent audio came within the wait."""
    ff.navigate(app.base_url + "/")
    ff.start_call()
    try:
        ff.wait_for("window.__t.first_audible !== undefined", WAIT_SECONDS, "the first audible packet")
    except AssertionError as exc:
        log.warning("%s", exc)
    marks = ff.evaluate("window.__t")
    if ff.evaluate(f"{RECORD} !== null && {RECORD}.innerText.includes('Stop')"):
        ff.evaluate(f"{RECORD}.click()")
    slot_freed(app)
    return marks


def measure(version: str, root: Path, calls: int, mic_wav: Path, work: Path, cache_dir: Path) -> list[dict]:
    rows = []
    with launched_app(work / f"app-{version}", cache_dir, args=["--slots", "2"], entry=str(root / "app.py")) as app, \
            chromium(work / f"udd-{version}", mic_wav) as ctx, firefox(work / f"firefox-{version}") as ff:
        ff.preload(RECORD_PCS)
        ff.preload(CALL_TIMING)
        ff.preload(FIRST_AUDIBLE)
        chromium_call(ctx, app)  # the persona's prefill, once: every counted call finds it cached
        for n in range(calls):
            browsers = (("Chromium", lambda: chromium_call(ctx, app)), ("Firefox", lambda: firefox_call(ff, app)))
            for browser, call in browsers:
                marks = call()
                since = {name: marks[name] - marks["click"] if name in marks else None
                         for name in ("connected", "first_audible", "first_sound")}
                rows.append({"version": version, "browser": browser, "connected": since["connected"],
                             "audible": since["first_audible"], "played": since["first_sound"]})
                log.info("%s %s call %d, after Record (ms): %s", version, browser, n + 1, since)
                time.sleep(0.5)
    return rows


def report(rows: list[dict]) -> str:
    table = []
    for version in dict.fromkeys(r["version"] for r in rows):
        for browser in ("Chromium", "Firefox"):
            mine = [r for r in rows if r["version"] == version and r["browser"] == browser]
            connected = [r["connected"] for r in mine if r["connected"] is not None]
            audible = [r["audible"] for r in mine if r["audible"] is not None]
            played = [r["played"] for r in mine if r["played"] is not None]
            table.append([version, browser, len(mine), f"{len(audible)} of {len(mine)}", median(connected),
                          median(audible), f"{min(audible):.0f}-{max(audible):.0f}" if audible else "-",
                          median(played) if played else "(no sound device)"])
    return md_table(["version", "browser", "calls", "heard the agent", "Record -> connected p50 (ms)",
                     "Record -> first audible packet p50 (ms)", "range (ms)", "Record -> first sound played p50 (ms)"],
                    table)


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5, help="counted calls per browser and version")
    ap.add_argument("--before", type=Path, help="another checkout of the app, measured in the same run")
    ap.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    versions = [("before", a.before.resolve())] if a.before else []
    versions.append(("this", ROOT))
    with tempfile.TemporaryDirectory(prefix="first-sound-") as tmp:
        work = Path(tmp)
        mic_wav = make_mic_wav(work)
        rows = [row for version, root in versions for row in measure(version, root, a.calls, mic_wav, work, work / "hf")]
    body = report(rows)
    print(body)
    if a.write:
        replace_section("First sound after Record: Chromium and Firefox", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
