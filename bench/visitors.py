"""A shared link goes viral: what page loads and idle tabs do to the people talking.

Starts `python app.py --model tiny` (default topology, as a user starts it, with loopback ICE),
connects K real WebRTC callers (aiortc peers that drive the page's own events, bench/media.py) and,
once they are live, sends the visitors from a second process, so that the load generator's own
event loop never delays the callers' packets in this one:

- the visitor profile is recorded, not written by hand: headless Chromium opens the page (`--link`:
  `/`, or a deep link such as one the page's copy button makes) and stays
  idle for `--record-seconds`; every same-origin request it makes while loading is a page load
  (the HTML, the assets, the page's load events through Gradio's queue), and every request it
  repeats afterwards is what an idle tab does, at the interval it repeated at;
- `--tabs` visitors open the page before the window (at `--tab-rate`) and leave it open: during
  the window each repeats the idle requests at that interval, starting at a random phase;
- `--loads` visitors load the page at `--rate` per second, two seconds into the window. A visitor
  fetches the assets too when its browser cache is empty (`--cold`, the fraction of visitors),
  six requests at a time as a browser does; its page-load time runs from the first byte asked to
  the last load event answered;
- each visitor comes from its own loopback address (127.x.y.z), as visitors do from theirs;
  `--flood` adds one address that loads the page as fast as it can, 16 at a time, for the window.

For each caller it reports the agent audio received per second of the window and the longest gap
between audio frames; for the room, the resyncs and the callers' input frames dropped
(`/api/status`, before and after the window); for the visitors, the page-load p50/p95/max, the
answers other than 200 (refused ones separately), and the idle requests' p95.

    python bench/visitors.py --slots 2 --callers 2 --loads 300 --rate 50 --tabs 200 [--compare DIR] [--write]
    python bench/visitors.py --loads 0 --tabs 0 --flood     (one address as fast as it can)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import media  # noqa: E402
from bench.common import REPO, md_table, publish  # noqa: E402

log = logging.getLogger("bench.visitors")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
ASSET = re.compile(r"^/(assets/|static/|gradio_api/custom_component/|theme\.css|favicon)")
PARALLEL = 6  # requests a browser keeps open to one host at once (HTTP/1.1)
FLOOD = 16  # requests the flooding address keeps open at once


# ---- the visitor profile, as Chromium loads and keeps the page -------------------------------------


@dataclass
class Request:
    method: str
    path: str  # with its query
    body: str | None = None  # JSON for a POST

    @property
    def is_asset(self) -> bool:
        return bool(ASSET.match(self.path))

    @property
    def is_event(self) -> bool:
        return self.path.startswith("/gradio_api/queue/join")

    def key(self) -> tuple:
        fn = json.loads(self.body).get("fn_index") if self.is_event and self.body else None
        return self.method, self.path.split("?")[0], fn


@dataclass
class Profile:
    load: list[Request]  # in the order the browser asked, the page's event streams left out
    idle: list[tuple[Request, float]]  # what an open tab repeats, and how often (seconds)

    def describe(self) -> str:
        assets = sum(r.is_asset for r in self.load)
        events = sum(r.is_event for r in self.load)
        idle = ", ".join(f"{r.method} {r.key()[1]}{' fn ' + str(r.key()[2]) if r.is_event else ''} every {p:.1f} s"
                         for r, p in self.idle) or "nothing"
        return (f"a page load is {len(self.load) - assets - events} page request(s), {assets} asset(s) and "
                f"{events} event(s); an open tab repeats {idle}")


def record_profile(base: str, seconds: float, link: str = "/") -> Profile:
    from playwright.sync_api import sync_playwright

    seen: list[tuple[float, Request]] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
        page = browser.new_page()
        t0 = time.monotonic()

        def on_request(r) -> None:
            if r.url.startswith(base):
                seen.append((time.monotonic() - t0, Request(r.method, r.url[len(base):] or "/", r.post_data)))

        page.on("request", on_request)
        page.goto(base + link, wait_until="networkidle")
        loaded = time.monotonic() - t0
        page.wait_for_timeout(seconds * 1000)  # events are delivered while playwright waits
        browser.close()
    # A join's event stream is opened by the replay itself.
    seen = [(t, r) for t, r in seen if not r.path.startswith("/gradio_api/queue/data")]
    load = [r for t, r in seen if t <= loaded + 0.3]
    later: dict[tuple, list[tuple[float, Request]]] = collections.defaultdict(list)
    for t, r in seen:
        if t > loaded + 0.3:
            later[r.key()].append((t, r))
    idle = []
    for times in later.values():
        stamps = [t for t, _ in times]
        period = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else stamps[0] - loaded
        idle.append((times[0][1], max(0.5, period)))
    return Profile(load, idle)


# ---- the visitors' process --------------------------------------------------------------------------


@dataclass
class VisitorResults:
    page_loads: list[float] = field(default_factory=list)  # seconds, one per page load that completed
    idle: list[float] = field(default_factory=list)  # seconds, one per idle request
    statuses: collections.Counter = field(default_factory=collections.Counter)  # non-200 answers by status
    failures: collections.Counter = field(default_factory=collections.Counter)  # no answer, by error
    refused_loads: int = 0  # page loads answered 429 or 503 at the HTML
    flood_loads: int = 0  # the flood's page loads answered 200
    flood_refused: int = 0
    cpu_s: float = 0.0


class Visitor:
    """One browser tab: its own source address and Gradio session."""

    def __init__(self, http, base: str, profile: Profile, results: VisitorResults) -> None:
        self.http, self.base, self.profile, self.results = http, base, profile, results
        self.session = "".join(random.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=11))

    async def send(self, r: Request) -> int:
        try:
            if r.is_event:
                return await self.event(r)
            async with self.http.request(r.method, self.base + r.path) as resp:
                await resp.read()
                if resp.status not in (200, 304):
                    self.results.statuses[resp.status] += 1
                return resp.status
        except Exception as e:  # noqa: BLE001 - an unanswered request is counted, not raised
            self.results.failures[type(e).__name__] += 1
            return 0

    async def event(self, r: Request) -> int:
        """A Gradio event as the page raises it: join the queue, read the session's stream to the end."""
        body = json.loads(r.body or "{}") | {"session_hash": self.session}
        async with self.http.post(self.base + r.path, json=body) as resp:
            if resp.status != 200:
                self.results.statuses[resp.status] += 1
                await resp.read()
                return resp.status
            event_id = (await resp.json())["event_id"]
        async with self.http.get(f"{self.base}/gradio_api/queue/data", params={"session_hash": self.session}) as s:
            async for raw in s.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    msg = json.loads(line[5:])
                    if msg.get("msg") == "close_stream" or (
                            msg.get("msg") == "process_completed" and msg.get("event_id") == event_id):
                        break
        return 200

    async def load_page(self, cold: bool) -> bool:
        """The page as a browser loads it: the HTML, then (cold) the assets six at a time, then the events."""
        t0 = time.monotonic()
        first, *rest = self.profile.load
        if await self.send(first) != 200:
            self.results.refused_loads += 1
            return False
        assets = [r for r in rest if r.is_asset]
        if cold:
            gate = asyncio.Semaphore(PARALLEL)

            async def fetch(r: Request) -> None:
                async with gate:
                    await self.send(r)

            await asyncio.gather(*(fetch(r) for r in assets))
        for r in rest:
            if not r.is_asset:
                await self.send(r)
        self.results.page_loads.append(time.monotonic() - t0)
        return True

    async def stay(self, until: float) -> None:
        """An open tab: the idle requests at their intervals until `until`, from a random phase."""
        async def repeat(r: Request, period: float) -> None:
            await asyncio.sleep(random.uniform(0, period))
            while time.monotonic() < until:
                t0 = time.monotonic()
                await self.send(r)
                self.results.idle.append(time.monotonic() - t0)
                await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))

        await asyncio.gather(*(repeat(r, p) for r, p in self.profile.idle))


def address(i: int) -> str:
    """Visitor i's loopback source address: 127.1.0.1, 127.1.0.2, ... (the callers use 127.0.0.1)."""
    return f"127.{1 + i // 65000}.{(i % 65000) // 250}.{1 + i % 250}"


async def visitors_run(base: str, profile: Profile, a: dict) -> VisitorResults:
    import aiohttp

    results = VisitorResults()
    sessions: list[aiohttp.ClientSession] = []

    def session(i: int, limit: int = PARALLEL) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(local_addr=(address(i), 0), limit=limit, force_close=False)
        s = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))
        sessions.append(s)
        return s

    tabs = [Visitor(session(i), base, profile, results) for i in range(a["tabs"])]
    opened = []
    for tab in tabs:  # earlier visitors, who left the page open
        opened.append(asyncio.ensure_future(tab.load_page(random.random() < a["cold"])))
        await asyncio.sleep(1.0 / a["tab_rate"])
    await asyncio.gather(*opened)
    results.page_loads.clear()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the window starts
    t0, cpu0 = time.monotonic(), time.process_time()
    until = t0 + a["seconds"]
    jobs = [asyncio.ensure_future(tab.stay(until)) for tab in tabs]
    if a["flood"]:
        jobs.append(asyncio.ensure_future(flood(session(10 ** 6, FLOOD), base, profile, results, until)))
    await asyncio.sleep(2.0)
    loads = []
    for i in range(a["loads"]):
        visitor = Visitor(session(a["tabs"] + i), base, profile, results)
        loads.append(asyncio.ensure_future(visitor.load_page(random.random() < a["cold"])))
        await asyncio.sleep(max(0.0, t0 + 2.0 + (i + 1) / a["rate"] - time.monotonic()))
    await asyncio.gather(*loads, *jobs)
    results.cpu_s = time.process_time() - cpu0
    for s in sessions:
        await s.close()
    return results


async def flood(http, base: str, profile: Profile, results: VisitorResults, until: float) -> None:
    """One address loading the page (its HTML) as fast as it can, FLOOD at a time."""
    async def one() -> None:
        while time.monotonic() < until:
            try:
                async with http.get(base + profile.load[0].path) as r:
                    await r.read()
                    if r.status == 200:
                        results.flood_loads += 1
                    else:
                        results.flood_refused += 1
            except Exception as e:  # noqa: BLE001
                results.failures["flood " + type(e).__name__] += 1

    await asyncio.gather(*(one() for _ in range(FLOOD)))


def visitors_main(base: str, profile_path: str, options: str) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    raw = json.loads(Path(profile_path).read_text())
    profile = Profile([Request(**r) for r in raw["load"]], [(Request(**r), p) for r, p in raw["idle"]])
    r = asyncio.run(visitors_run(base, profile, json.loads(options)))
    print(json.dumps({**r.__dict__, "statuses": dict(r.statuses), "failures": dict(r.failures)}), flush=True)


# ---- one run: callers, then visitors ------------------------------------------------------------------


@dataclass
class Row:
    app: str
    audio: list[float]  # per caller, s/s
    gaps_ms: list[float]
    resyncs: int
    input_drops: int
    visitors: dict
    profile: str = ""

    def errors(self) -> str:
        """The answers other than 200 (by status) and the requests with no answer (by error)."""
        found = {**{f"HTTP {k}": n for k, n in self.visitors["statuses"].items()}, **self.visitors["failures"]}
        return ", ".join(f"{k}: {n}" for k, n in sorted(found.items()))

    def cells(self) -> list:
        v = self.visitors
        loads = sorted(v["page_loads"])
        pct = (lambda q: f"{1e3 * loads[min(len(loads) - 1, int(q * len(loads)))]:.0f}") if loads else (lambda q: "-")
        idle = sorted(v["idle"])
        other = sum(v["statuses"].values()) + sum(v["failures"].values())
        flood = f"{v['flood_loads']} / {v['flood_refused']}" if v["flood_loads"] or v["flood_refused"] else "-"
        return [self.app, " / ".join(f"{x:.2f}" for x in self.audio), " / ".join(f"{g:.0f}" for g in self.gaps_ms),
                self.resyncs, self.input_drops, f"{len(loads)}", f"{pct(0.5)} / {pct(0.95)} / {pct(1.0)}",
                v["refused_loads"], other,
                f"{1e3 * idle[int(0.95 * (len(idle) - 1))]:.0f}" if idle else "-", flood, f"{v['cpu_s']:.1f}"]


HEADERS = ["app", "agent audio per caller (s/s)", "longest gap (ms)", "resyncs", "input frames dropped",
           "page loads done", "page load p50 / p95 / max (ms)", "loads refused", "other errors",
           "idle request p95 (ms)", "flood: served / refused", "visitors' CPU (s)"]


async def callers_and_visitors(app: media.App, a, profile_path: Path) -> Row:
    import aiohttp

    options = json.dumps(dict(tabs=a.tabs, tab_rate=a.tab_rate, loads=a.loads, rate=a.rate, cold=a.cold,
                              seconds=a.seconds, flood=a.flood))
    visitors = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--visitors-run", app.base, str(profile_path), options, cwd=REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    async with aiohttp.ClientSession() as http:
        async with http.get(app.base + "/config") as r:
            events = media.PageEvents.from_config(await r.json())
        callers = [media.PageCaller(http, app.base, events, i) for i in range(a.callers)]
        for c in callers:
            await c.start()
            await asyncio.sleep(0.3)
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(app.status))["slots_live"] < a.callers:
            if time.monotonic() > deadline:
                raise RuntimeError("the callers did not all go live")
            await asyncio.sleep(0.5)
        ready = await visitors.stdout.readline()  # the open tabs are loaded
        if ready.strip() != b"ready":
            raise RuntimeError(f"the visitors' process said {ready!r}")
        await asyncio.sleep(a.settle)
        before = await asyncio.to_thread(app.status)
        t0 = time.monotonic()
        for c in callers:
            c.window = (t0, t0 + a.seconds)
        visitors.stdin.write(b"go\n")
        await visitors.stdin.drain()
        await asyncio.sleep(a.seconds)
        after = await asyncio.to_thread(app.status)
        out = await visitors.stdout.readline()
        await visitors.wait()
        for c in callers:
            await c.stop()
    return Row(app="", audio=[c.result.audio_s / a.seconds for c in callers],
               gaps_ms=[1e3 * c.result.longest_gap_s for c in callers],
               resyncs=after["resyncs"] - before["resyncs"], input_drops=after["input_drops"] - before["input_drops"],
               visitors=json.loads(out))


def run_app(name: str, repo: Path, a) -> tuple[Row, str]:
    """One app: its page's profile recorded (an older page raises other events), then the run."""
    app = media.App(a.slots, a.app_args.split(), a.cache_dir, repo, threads=None)
    profile_path = Path(tempfile.mkstemp(prefix="visitor-profile-", suffix=".json")[1])
    try:
        profile = record_profile(app.base, a.record_seconds, a.link)
        profile_path.write_text(json.dumps({"load": [r.__dict__ for r in profile.load],
                                            "idle": [(r.__dict__, p) for r, p in profile.idle]}))
        described = profile.describe()
        log.info("%s: %s", name, described)
        row = asyncio.run(media.with_loopback(callers_and_visitors(app, a, profile_path)))
    finally:
        app.close()
        profile_path.unlink(missing_ok=True)
    row.app, row.profile = name, described
    log.info("%s", md_table(HEADERS, [row.cells()]))
    return row, described


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--callers", type=int, default=2)
    ap.add_argument("--loads", type=int, default=300, help="page loads during the window")
    ap.add_argument("--rate", type=float, default=50.0, help="page loads per second")
    ap.add_argument("--tabs", type=int, default=200, help="open tabs, loaded before the window")
    ap.add_argument("--tab-rate", type=float, default=25.0, help="how fast the open tabs were loaded (per second)")
    ap.add_argument("--cold", type=float, default=0.0,
                    help="fraction of visitors whose browser cache is empty (they fetch every asset)")
    ap.add_argument("--link", default="/", help="the link the visitors open, e.g. a deep link '/?voice=NATM1&seed=7'")
    ap.add_argument("--flood", action="store_true", help="one more address loading the page as fast as it can")
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--record-seconds", type=float, default=12.0, help="how long Chromium keeps the page open")
    ap.add_argument("--app-args", default="", help="extra flags for app.py")
    ap.add_argument("--compare", default=None, metavar="DIR", help="also run app.py from another checkout, first")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--section", default="A shared link goes viral: page loads and idle tabs beside live calls")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    media.SpeechLikeTrack = media.make_track_class()
    apps = [("app", REPO)]
    if a.compare:
        other = Path(a.compare).resolve()
        commit = subprocess.run(["git", "-C", str(other), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or other.name
        apps.insert(0, (f"app at {commit}", other))
    rows, profiles = [], {}
    for _ in range(a.repeat):
        for name, repo in apps:
            row, described = run_app(name, repo, a)
            rows.append(row)
            profiles.setdefault(name, described)
    shape = f" `{a.app_args}`" if a.app_args else ", each app in its default topology"
    load = (f"{a.callers} callers at `--slots {a.slots}`{shape}; {a.tabs} open tabs, "
            f"then {a.loads} page loads at {a.rate:g}/s two seconds into a {a.seconds:g} s window; "
            f"{a.cold:.0%} of visitors with an empty cache" + ("; one address flooding" if a.flood else "")
            + (f"; every visitor opens `{a.link}`" if a.link != "/" else ""))
    errors = [f"- {r.app}, run {1 + [x.app for x in rows[:i]].count(r.app)}: other errors {r.errors()}."
              for i, r in enumerate(rows) if r.errors()]
    body = (f"{load}.\n\n" + md_table(HEADERS, [r.cells() for r in rows]) + "\n\n"
            + "\n".join([f"- Profile of {name}: {p}." for name, p in profiles.items()] + errors))
    publish(a.section, body, a.write)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--visitors-run":
        logging.basicConfig(level=logging.WARNING)
        visitors_main(*sys.argv[2:5])
    else:
        main()
