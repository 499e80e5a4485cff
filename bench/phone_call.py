"""The round trip through the phone door beside the page's, on one app with a loopback engine.

The app runs bench/loopback_app.py (each caller hears their own audio one step after the room
took it: the model's floor is 160 ms), with the phone door on. Calls alternate:

- a page call in Debian's Chromium, its microphone a click a second, both the clicks it sends and
  those that come back read with MediaStreamTrackProcessor (as bench/browser_call.py reads them);
- a phone call as Twilio places it (tests/phone_network.py: the signed webhook, then Media
  Streams in real time), its audio the same click (10 ms of 1 kHz) once a second in mu-law. A
  click's time out is when its first sample was captured (the 20 ms chunk that carries it leaves
  when the chunk is full); its time back is when it would play on a phone that plays each chunk
  as it arrives (after the one before it): no jitter buffer of the carrier's is counted, as none
  of the browser's network is.

    python bench/phone_call.py [--calls 4] [--seconds 15] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.browser_call import one_round_trip_call  # noqa: E402
from bench.common import command_line, machine, md_table, replace_section  # noqa: E402
from tests.browser_support import chromium, click_trips, launched_app, make_mic_wav  # noqa: E402
from tests.phone_network import CHUNK, RATE, PhoneStream, linear, mulaw, place_call  # noqa: E402

log = logging.getLogger("bench.phone_call")
ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-auth-token"
THRESHOLD = 0.1 * 32768  # a click's onset, as the page's reader finds it


def click_track(seconds: float) -> np.ndarray:
    """Silence with a 10 ms 1 kHz click at the start of every second, 8 kHz int16."""
    pcm = np.zeros(int(seconds * RATE), np.int16)
    n = RATE // 100
    click = 0.6 * 32767 * np.sin(2 * np.pi * 1000 * np.arange(n) / RATE) * np.sin(np.pi * np.arange(n) / n)
    for start in range(0, pcm.size - n, RATE):
        pcm[start:start + n] = click.astype(np.int16)
    return pcm


async def phone_round_trip(base_url: str, seconds: float) -> list[float]:
    """One phone call of clicks: the round trip of each click that came back, in ms."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        twiml = await place_call(http, f"{base_url}/telephony/twilio?voice=NATF2", TOKEN)
    async with PhoneStream(twiml) as stream:
        deadline = time.monotonic() + 30
        while "live" not in stream.mark_names():
            if time.monotonic() > deadline:
                raise RuntimeError("the phone call did not go live")
            await asyncio.sleep(0.05)
        heard_from = len(stream.heard)
        data = mulaw(click_track(seconds))
        sent: list[float] = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(len(data) // CHUNK):
            chunk = data[i * CHUNK:(i + 1) * CHUNK]
            await stream.media(chunk)
            if (i * CHUNK) % RATE == 0:  # this chunk starts with a click, captured 20 ms ago
                sent.append(1e3 * (time.monotonic() - CHUNK / RATE))
            await asyncio.sleep(max(0.0, start + (i + 1) * CHUNK / RATE - loop.time()))
        await asyncio.sleep(1.0)
        back = played_onsets(stream, heard_from)
    trips = click_trips([s for s in sent if s < max(back, default=0.0) - 1000.0], back)
    return [t for _, t in trips]


def played_onsets(stream: PhoneStream, heard_from: int) -> list[float]:
    """When each click that came back would start playing (ms), each chunk played on arrival or
    after the one before it, whichever is later."""
    onsets, playing_until, quiet_until, before = [], 0.0, 0.0, 0
    for at, total in stream.arrivals:
        chunk = linear(bytes(stream.heard[before:total]))
        start, before = max(at, playing_until), total
        playing_until = start + chunk.size / RATE
        if total <= heard_from:
            continue
        loud = np.flatnonzero(np.abs(chunk.astype(np.int32)) > THRESHOLD)
        if loud.size:
            t = 1e3 * (start + loud[0] / RATE)
            if t > quiet_until:
                onsets.append(t)
                quiet_until = t + 300
    return onsets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4, help="calls per door, alternating")
    ap.add_argument("--seconds", type=float, default=15.0, help="of clicks per call")
    ap.add_argument("--write", action="store_true", help="write the section of BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    page_trips: list[float] = []
    phone_trips: list[float] = []
    with tempfile.TemporaryDirectory(prefix="phone-call-") as tmp:
        work = Path(tmp)
        with launched_app(work / "app", work / "hf", args=["--slots", "2"], env={"TWILIO_AUTH_TOKEN": TOKEN},
                          entry=str(ROOT / "bench" / "loopback_app.py")) as app, \
                chromium(work / "udd", make_mic_wav(work)) as ctx:
            for i in range(a.calls):
                page_trips += one_round_trip_call(ctx, app, a.seconds)["trips"]
                # Playwright's sync API holds this thread's event loop: the phone call runs on its own.
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    phone_trips += pool.submit(asyncio.run, phone_round_trip(app.base_url, a.seconds)).result()
                log.info("call %d: page p50 %.0f ms, phone p50 %.0f ms", i + 1, statistics.median(page_trips),
                         statistics.median(phone_trips))
    body = report(page_trips, phone_trips, a.calls, a.seconds)
    print(body)
    if a.write:
        replace_section("The phone door's round trip", body, command_line(), machine())
    return 0


def report(page: list[float], phone: list[float], calls: int, seconds: float) -> str:
    def row(name: str, trips: list[float]) -> list:
        x = np.array(trips)
        p50, p95 = np.percentile(x, 50), np.percentile(x, 95)
        return [name, x.size, f"{p50:.0f}", f"{p95:.0f}", f"{p50 - 160:.0f}"]

    table = md_table(["door", "clicks back", "p50 (ms)", "p95 (ms)", "p50 over the model's 160 ms floor"],
                     [row("page (Chromium, WebRTC)", page), row("phone (Twilio Media Streams)", phone)])
    diff = np.percentile(phone, 50) - np.percentile(page, 50)
    return (f"{table}\n\nOne app (`--slots 2`, loopback engine, default topology), {calls} calls of {seconds:.0f} s "
            f"per door, alternating. The phone door's p50 is {diff:+.0f} ms against the page's. The phone "
            "network's own legs (the carrier, Twilio's media servers, its jitter buffer) come on top and are "
            "not measured here.")


if __name__ == "__main__":
    sys.exit(main())
