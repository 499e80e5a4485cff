"""Visitors and callers: the page's cached answers, the per-address limits, and a call that goes on
while visitors come in a burst and one address floods the page (docs/serving.md § Visitors and callers)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import brotli
import httpx
import pytest

from personaplex_demo.web.page_cache import PageCache
from personaplex_demo.web.visitor_limits import VisitorCounts, VisitorLimits

from .browser_support import launched_app
from .callers import PageCaller, PageConfig, until

LOAD_SCRIPT = Path(__file__).parent / "support" / "visitor_load.py"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scope(path: str = "/", method: str = "GET", client: str = "10.0.0.1", query: bytes = b"",
          headers: list | None = None) -> dict:
    return {"type": "http", "method": method, "path": path, "query_string": query, "client": (client, 5000),
            "scheme": "http", "root_path": "", "headers": headers or [(b"host", b"demo.example")]}


async def call(app, s: dict, body: bytes = b"") -> list[dict]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(s, receive, send)
    return sent


def headers_of(sent: list[dict]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


# ---- per-address limits -----------------------------------------------------------------------------


class Page:
    """The app behind the middleware: records what reached it, answers 200."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = (await receive()).get("body", b"")
        self.seen.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def join(fn: int) -> bytes:
    return json.dumps({"data": [], "fn_index": fn, "session_hash": "abc"}).encode()


async def test_one_address_is_limited_and_the_others_and_every_call_go_on():
    clock, page, counts = FakeClock(), Page(), VisitorCounts()
    limits = VisitorLimits(page, frozenset({3, 4}), page_loads_per_minute=60, counts=counts, clock=clock)
    answers = [(await call(limits, scope()))[0]["status"] for _ in range(40)]
    assert answers == [200] * 30 + [429] * 10  # half a minute's worth at once, then one a second
    refused = await call(limits, scope())
    assert headers_of(refused)[b"retry-after"] == b"1" and b"http-equiv=refresh content=1" in refused[1]["body"]
    assert (await call(limits, scope(client="10.0.0.2")))[0]["status"] == 200  # another visitor
    clock.now += 1.0
    assert (await call(limits, scope()))[0]["status"] == 200  # a second later, one more
    assert counts.page_loads_refused == 11

    # Visitor events: ten times the page rate. A call's own events are never counted nor refused,
    # and reach the app with their body intact.
    joins = [(await call(limits, scope("/gradio_api/queue/join", "POST"), join(9)))[0]["status"] for _ in range(320)]
    assert joins.count(200) == 300 and joins[-1] == 429
    refused = await call(limits, scope("/gradio_api/queue/join", "POST"), join(9))
    assert json.loads(refused[1]["body"])["detail"].startswith("Too many requests from your address")
    assert (await call(limits, scope("/api/room")))[0]["status"] == 429  # the room's figures count as events
    for fn in (3, 4) * 50:
        assert (await call(limits, scope("/gradio_api/queue/join", "POST"), join(fn)))[0]["status"] == 200
    assert page.seen[-1] == ("/gradio_api/queue/join", join(4))
    # Everything else passes: the call's offer, assets, the event stream.
    for path in ("/gradio_api/component_server/", "/assets/index.js", "/gradio_api/queue/data"):
        assert (await call(limits, scope(path, "POST" if "server" in path else "GET")))[0]["status"] == 200


async def test_behind_a_proxy_each_forwarded_address_has_its_own_limit():
    clock = FakeClock()

    def via_proxy(address: str) -> dict:
        return scope(client="10.9.9.9", headers=[(b"x-forwarded-for", f"6.6.6.6, {address}".encode())])

    trusted = VisitorLimits(Page(), frozenset(), page_loads_per_minute=2, trust_forwarded_for=True,
                            clock=clock)
    assert [(await call(trusted, via_proxy(a)))[0]["status"] for a in ("1.1.1.1", "1.1.1.1", "2.2.2.2")] == \
        [200, 429, 200]  # the proxy's last hop names the visitor; what the client wrote before it does not count
    direct = VisitorLimits(Page(), frozenset(), page_loads_per_minute=2, clock=clock)
    assert [(await call(direct, via_proxy(a)))[0]["status"] for a in ("1.1.1.1", "2.2.2.2")] == [200, 429]


async def test_too_many_visitor_requests_at_once_are_asked_to_come_back():
    release, inside = asyncio.Event(), []

    async def slow(scope, receive, send):
        inside.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    counts = VisitorCounts()
    limits = VisitorLimits(slow, frozenset({1}), page_loads_per_minute=0, counts=counts, max_in_flight=3)
    waiting = [asyncio.ensure_future(call(limits, scope(client=f"10.0.0.{i}"))) for i in range(3)]
    await until(lambda: len(inside) == 3, 2, "three requests inside")
    busy = await call(limits, scope(client="10.0.0.9"))
    assert busy[0]["status"] == 503 and b"busy with live calls" in busy[1]["body"] and counts.busy_refused == 1
    call_event = asyncio.ensure_future(call(limits, scope("/gradio_api/queue/join", "POST"), join(1)))
    await until(lambda: len(inside) == 4, 2, "a call's event, however busy")
    release.set()
    assert [s[0]["status"] for s in await asyncio.gather(*waiting, call_event)] == [200] * 4


# ---- the page's cached answers ------------------------------------------------------------------------


class Rendered:
    """Gradio's side: renders each request anew (in chunks, as a file is sent) and counts it."""

    def __init__(self, status: int = 200, content_type: bytes = b"text/html; charset=utf-8") -> None:
        self.status, self.content_type, self.renders = status, content_type, 0

    async def __call__(self, scope, receive, send) -> None:
        self.renders += 1
        await asyncio.sleep(0.01)
        host = dict(scope["headers"]).get(b"host", b"")
        body = b"<html>root http://" + host + scope["path"].encode() + b" " + b"x" * 2000 + b"</html>"
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", self.content_type), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body[:1000], "more_body": True})
        await send({"type": "http.response.body", "body": body[1000:]})


def mutating(app):
    """Gradio's compression, outside every app middleware: it rewrites the start message's headers
    in place. The cache must keep what the app said, not what left the server."""
    async def outer(scope, receive, send):
        async def rewrite(message):
            if message["type"] == "http.response.start":
                message["headers"].append((b"content-encoding", b"br"))
            await send(message)
        await app(scope, receive, rewrite)
    return outer


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent[1:])


async def test_the_page_is_rendered_once_for_a_burst_and_kept_per_address():
    gradio = Rendered()
    cache = PageCache(gradio)
    outer = mutating(cache)
    first = await asyncio.gather(*(call(outer, scope(query=b"voice=NATM1&seed=7")) for _ in range(20)))
    assert gradio.renders == 1  # twenty visitors at once: one render, the others wait for it
    assert len({body_of(s) for s in first}) == 1
    plain = await call(cache, scope())  # a deep link's parameters are the load event's, not the page's
    assert gradio.renders == 1 and body_of(plain) == body_of(first[0])
    assert b"content-encoding" not in headers_of(plain)  # what the app said, not what the outside added
    other = await call(cache, scope(headers=[(b"host", b"mirror.example")]))
    assert gradio.renders == 2 and b"http://mirror.example/" in body_of(other)  # the page names its address
    await call(cache, scope(query=b"page=docs"))
    assert gradio.renders == 3  # a query Gradio reads is part of the key

    etag = headers_of(plain)[b"etag"]
    assert (await call(cache, scope(headers=[(b"host", b"demo.example"), (b"if-none-match", etag)])))[0]["status"] == 304
    packed = await call(cache, scope(headers=[(b"host", b"demo.example"), (b"accept-encoding", b"gzip, br")]))
    assert headers_of(packed)[b"content-encoding"] == b"br"
    assert brotli.decompress(body_of(packed)) == body_of(plain)
    assert int(headers_of(packed)[b"content-length"]) == len(body_of(packed)) < len(body_of(plain))


async def test_built_files_are_immutable_and_failures_are_not_kept():
    built = PageCache(Rendered(content_type=b"text/javascript"))
    for _ in range(3):
        sent = await call(built, scope("/assets/Index-CDBfCghh.js"))
    # A name that carries its content's hash: a browser may keep it for good.
    assert headers_of(sent)[b"cache-control"] == b"public, max-age=31536000, immutable"
    for made_up in (b"v=1", b"v=2", b"x=" + b"y" * 100):  # one entry per file, whatever the query
        await call(built, scope("/assets/Index-CDBfCghh.js", query=made_up, headers=[(b"host", made_up)]))
    assert built.app.renders == 1

    failing = Rendered(status=500)
    cache = PageCache(failing)
    for _ in range(2):
        await call(cache, scope())
    assert failing.renders == 2
    for path, method in (("/gradio_api/queue/join", "POST"), ("/api/status", "GET"), ("/", "HEAD")):
        passing = Rendered()
        cache = PageCache(passing)
        await call(cache, scope(path, method))
        await call(cache, scope(path, method))
        assert passing.renders == 2, path  # not a static answer: never cached


# ---- a call while visitors come -------------------------------------------------------------------------


def niceness(pid: int) -> dict[int, int]:
    """Each thread's niceness (Linux: field 19 of /proc/PID/task/TID/stat)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found[int(task.name)] = int(fields[16])
    return found


@pytest.fixture(scope="module")
def app(tiny_cache_dir, tmp_path_factory):
    # The default topology, as a user starts it (one media worker wherever there are two cores).
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=["--slots", "2"]) as launched:
        yield launched


async def test_a_call_goes_on_while_visitors_come_and_one_address_floods(app):
    """A burst of page loads from many addresses (some through a deep link), open tabs asking for
    the room's figures, and one address loading the page as fast as it can, all while a real
    WebRTC caller talks: the call keeps its audio and the room never resynchronises; the flooding
    address is limited, the others are served."""
    status = app.status()
    assert len(status["media_workers"]) == (1 if (os.cpu_count() or 1) >= 2 else 0)
    if status["media_workers"]:  # the web server's thread yields the cores to the calls' processes
        assert sorted(set(niceness(app.proc.pid).values())) == [0, 10], niceness(app.proc.pid)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        caller = PageCaller(http, await PageConfig.fetch(http))
        await caller.offer(220.0)
        await caller.wait_connected()
        await until(lambda: caller.status.startswith("Live") and caller.samples > 24000, 30, "the call live")
        before = app.status()
        # The visitors come from another process, as from other machines; it yields the cores to the app.
        load = asyncio.create_task(asyncio.to_thread(
            subprocess.run, [sys.executable, str(LOAD_SCRIPT), app.base_url, "--seconds", "8"],
            capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.nice(10)))
        heard = await caller.audio_seconds_over(8.0)
        done = await load
        after = app.status()
        await caller.hang_up()
    assert done.returncode == 0, done.stderr[-2000:]
    visitors = json.loads(done.stdout.strip().splitlines()[-1])
    assert heard >= 0.9 * 8.0, (heard, visitors)
    assert after["resyncs"] == before["resyncs"], visitors
    # Sixty addresses, one page load each, and forty open tabs: none is refused for its address.
    assert visitors["pages"].get("429", 0) == 0 and visitors["pages"].get("200", 0) > 0, visitors
    assert visitors["tabs"].get("429", 0) == 0 and visitors["tabs"].get("200", 0) > 0, visitors
    assert set(visitors["events"]) == {"200"}, visitors  # a deep link's query, applied
    # The flood: half a minute's worth at once, then about one a second.
    flood = visitors["flood"]
    assert 30 <= flood.get("200", 0) <= 30 + 8 + 2 and flood.get("429", 0) > flood["200"], flood
    assert after["visitors"]["page_loads_refused"] >= flood["429"]
    metrics = dict(line.rsplit(" ", 1) for line in app.metrics().splitlines() if line[:1] not in ("#", ""))
    assert float(metrics['personaplex_visitors_refused_total{why="page_loads"}']) >= flood["429"]
