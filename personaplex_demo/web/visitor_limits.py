"""Visitors' work is bounded; callers' never is (docs/serving.md § Visitors and callers): page loads and the
page's events that are not a call's are limited per client address (a token bucket) and all together
(`max_in_flight`). A refused page load gets a short page that reloads itself when the address may load again.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from starlette.responses import Response

from ..addresses import client_address
from .page_cache import PAGE_PATHS

log = logging.getLogger(__name__)

JOIN_PATH = "/gradio_api/queue/join"
# (path, method) -> what the request is: a page load, an event (its fn_index tells a call's from a visitor's),
# or the room's figures, a visitor's event.
KINDS = {**{(path, method): "page" for path in PAGE_PATHS for method in ("GET", "HEAD")},
         (JOIN_PATH, "POST"): "join", ("/api/room", "GET"): "event"}
MAX_JOIN_BODY = 1 << 20  # an event's inputs: the persona at most, far below this
MAX_ADDRESSES = 20_000  # addresses remembered at once; the longest idle is forgotten first
REPORT_SECONDS = 60.0


@dataclass
class Bucket:
    """Tokens refilled at `rate` a second up to `capacity`; a request takes one."""

    capacity: float
    rate: float
    tokens: float
    stamp: float

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class VisitorCounts:
    """What was refused, for /api/status."""

    page_loads_refused: int = 0  # over the per-address rate
    events_refused: int = 0
    busy_refused: int = 0  # over `max_in_flight`, all addresses together
    addresses: set[str] = field(default_factory=set)  # refused since the last log line

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "addresses"}


class VisitorLimits:
    """ASGI middleware. `call_events` are the fn_index of the page's call events, never limited."""

    def __init__(self, app, call_events: frozenset[int], page_loads_per_minute: int,
                 trust_forwarded_for: bool = False, counts: VisitorCounts | None = None,
                 max_in_flight: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.call_events, self.clock = app, call_events, clock
        self.per_minute, self.max_in_flight = page_loads_per_minute, max_in_flight  # per_minute 0: no limit
        self.trust_forwarded_for = trust_forwarded_for
        self.counts = counts if counts is not None else VisitorCounts()
        self._buckets: collections.OrderedDict[tuple[str, str], Bucket] = collections.OrderedDict()
        self._in_flight = 0
        self._reported = clock()

    async def __call__(self, scope, receive, send) -> None:
        kind = KINDS.get((scope["path"], scope["method"])) if scope["type"] == "http" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        if kind == "join":
            body = await read_body(receive)
            if body is None:  # the client went away, or sent far more than any event holds
                await refusal(413, "This event is larger than any the page sends.", 0, json_body=True)(scope, receive, send)
                return
            receive = replay(body, receive)
            if fn_index(body) in self.call_events:
                await self.app(scope, receive, send)
                return
            kind = "event"
        address = self.address(scope)
        wait = self.wait(kind, address)
        why = kind if wait else "busy" if self._in_flight >= self.max_in_flight else None
        if why is not None:
            self.refused(why, address)
            status, message = REFUSALS[why]
            await refusal(status, message, wait or 2.0, json_body=kind != "page")(scope, receive, send)
            return
        self._in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight -= 1

    def address(self, scope) -> str:
        peer = scope["client"][0] if scope.get("client") else None
        if not self.trust_forwarded_for:
            return peer or "unknown"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return client_address(headers, peer, True)

    def wait(self, kind: str, address: str) -> float:
        """0 when `address` may go on, else the seconds until it may."""
        if not (per_minute := self.per_minute):
            return 0.0
        now = self.clock()
        bucket = self._buckets.get((kind, address))
        if bucket is None:
            # Half a minute's page loads at once (a classroom behind one address); events ten times as many.
            scale = 1 if kind == "page" else 10
            capacity, rate = scale * max(1.0, per_minute / 2), scale * per_minute / 60
            bucket = self._buckets[(kind, address)] = Bucket(capacity, rate, capacity, now)
            while len(self._buckets) > MAX_ADDRESSES:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end((kind, address))
        return bucket.take(now)

    def refused(self, why: str, address: str) -> None:
        if why == "page":
            self.counts.page_loads_refused += 1
        elif why == "event":
            self.counts.events_refused += 1
        else:
            self.counts.busy_refused += 1
        self.counts.addresses.add(address)
        now = self.clock()
        if now - self._reported >= REPORT_SECONDS:
            c = self.counts
            log.warning("visitors refused so far: %d page loads and %d events over the per-address rate, %d while "
                        "the server was busy (%d address(es) in the last minute); calls are not limited",
                        c.page_loads_refused, c.events_refused, c.busy_refused, len(c.addresses))
            c.addresses.clear()
            self._reported = now


REFUSALS = {"page": (429, "Too many page loads from your address."),  # over the address's rate
            "event": (429, "Too many requests from your address."),
            "busy": (503, "The server is busy with live calls.")}  # over `max_in_flight`


async def read_body(receive) -> bytes | None:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if len(body) > MAX_JOIN_BODY:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def replay(body: bytes, receive):
    """`receive` for the app: the body already read, then the client's own messages (a disconnect)."""
    first = [{"type": "http.request", "body": body, "more_body": False}]

    async def again():
        return first.pop() if first else await receive()

    return again


def fn_index(body: bytes) -> int | None:
    try:
        value = json.loads(body).get("fn_index")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def refusal(status: int, message: str, retry_after: float, json_body: bool) -> Response:
    seconds = max(1, math.ceil(retry_after))
    headers = {"retry-after": str(seconds), "cache-control": "no-store"}
    if json_body:
        return Response(json.dumps({"detail": f"{message} Try again in {seconds} s."}), status, headers,
                        "application/json")
    # a browser: a page that comes back by itself
    return Response(f"<!doctype html><meta charset=utf-8><meta http-equiv=refresh content={seconds}>"
                    f"<title>PersonaPlex Live</title><p>{message} This page loads again in {seconds} s.</p>",
                    status, headers, "text/html; charset=utf-8")
