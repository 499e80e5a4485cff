"""The room's figures on every open page, for the price of a small cached answer: instead of a Gradio
timer event per tab, the page's script asks `GET /api/room` while the tab is visible, and puts the parts
in as text, never markup (docs/serving.md § Visitors and callers).
"""

from __future__ import annotations

import html
import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..serving.metrics import PoolMetrics
from ..serving.room import Room
from .assets import page_script
from .status import SharedFigures, room_line

REFRESH_SECONDS = 5.0  # how often a visible page asks for the figures
ANSWER_SECONDS = 1.0  # one answer serves every page that asks within this long


def figure_parts(m: PoolMetrics) -> list[tuple[str, str]]:
    """(label, text) pairs; an empty label is plain text."""
    if not m.ticks:  # zeros would read as measurements
        return [("Room", room_line(m)), ("", "latency and tick times appear once a call is live")]
    return [("Room", room_line(m)), ("latency", f"p50 {m.latency_p50_ms:.0f} ms, p99 {m.latency_p99_ms:.0f} ms"),
            ("tick", f"p50 {m.tick_p50_ms:.0f} ms, p99 {m.tick_p99_ms:.0f} ms"),
            ("real-time factor", f"{m.realtime_factor:.2f}")]


def figures_html(m: PoolMetrics) -> str:
    """The same parts as the page first shows them (the script replaces the span's text)."""
    text = " · ".join(f"<strong>{html.escape(label)}</strong> {html.escape(part)}" if label else html.escape(part)
                      for label, part in figure_parts(m))
    return f'<span class="room-figures">{text}</span>'


def room_routes(room: Room) -> list[Route]:
    """`GET /api/room`: the figures as JSON, the same bytes for every page while the shared
    snapshot (taken at most every ANSWER_SECONDS) is the same one."""
    figures = SharedFigures(room, ttl=ANSWER_SECONDS)
    kept: tuple[PoolMetrics, bytes] | None = None  # read and written on the server's loop only

    async def answer(_: Request) -> Response:
        nonlocal kept
        metrics = figures.get()
        if kept is None or kept[0] is not metrics:
            kept = (metrics, json.dumps({"parts": figure_parts(metrics), "refresh_seconds": REFRESH_SECONDS}).encode())
        return Response(kept[1], media_type="application/json", headers={"Cache-Control": "no-store"})

    return [Route("/api/room", answer, methods=["GET"])]


# The page's side: ask while visible, back off when refused, write text only.
ROOM_SCRIPT = page_script("room_figures.js", REFRESH=REFRESH_SECONDS)
