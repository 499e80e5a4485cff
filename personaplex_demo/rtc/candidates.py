"""The browser's trickled ICE candidates, added to the call's peer connection whichever browser sent
them and whenever they arrive (why: docs/design-notes.md, on every browser's ICE candidates). The answers
keep fastrtc's shape (`{"status": "success"}`, or `"failed"` with the reason in `meta.error`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc.sdp import candidate_from_sdp
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

WAIT_SECONDS = 5.0  # for the offer of a candidate that came first
POLL_SECONDS = 0.01  # the first look again; each later one waits twice as long, up to MAX_POLL_SECONDS
MAX_POLL_SECONDS = 0.2  # a candidate whose offer was refused costs the loop a few wake-ups, not hundreds


async def wait_until(ready: Callable[[], bool], seconds: float = WAIT_SECONDS) -> bool:
    """Until `ready()`, looking again at growing intervals; whether it came within `seconds`."""
    deadline, pause = time.monotonic() + seconds, POLL_SECONDS
    while not ready():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(2 * pause, MAX_POLL_SECONDS)
    return True


def answer(status: str, error: str | None = None) -> JSONResponse:
    """fastrtc's answer to a trickled candidate."""
    return JSONResponse(status_code=200, content={"status": status, **({"meta": {"error": error}} if error else {})})


def accepting_candidates(pcs: Callable[[], dict[str, Any]], handle_offer: Callable[..., Awaitable[Any]]):
    """`handle_offer`, with the trickled candidates of the connections in `pcs()` added here."""

    async def handle_offer_and_candidates(body, set_outputs):
        if body.get("type") == "ice-candidate" and isinstance(body.get("candidate"), dict):
            return await add_candidate(pcs, str(body.get("webrtc_id")), body["candidate"])
        return await handle_offer(body, set_outputs)

    return handle_offer_and_candidates


async def add_candidate(pcs: Callable[[], dict[str, Any]], webrtc_id: str, fields: dict[str, Any]) -> JSONResponse:
    text = str(fields.get("candidate") or "").strip()
    if not text:  # the end of the browser's candidates: nothing to add
        return answer("success")
    try:
        candidate = candidate_from_sdp(text.removeprefix("candidate:"))
    except (AssertionError, ValueError, IndexError):
        log.info("connection %s: an unreadable ICE candidate ignored: %.120s", webrtc_id, text)
        return answer("failed", "invalid_candidate_format")
    candidate.sdpMid, candidate.sdpMLineIndex = fields.get("sdpMid"), fields.get("sdpMLineIndex")
    if candidate.sdpMid is None and candidate.sdpMLineIndex is None:
        candidate.sdpMLineIndex = 0  # the page's one audio section (and its bundled data channel)
    def taken() -> bool:  # the offer is answered (or the connection is over already)
        pc = pcs().get(webrtc_id)
        return pc is not None and (pc.connectionState == "closed" or pc.remoteDescription is not None)

    if not await wait_until(taken):
        return answer("failed", "unknown_connection" if webrtc_id not in pcs() else "no_offer")
    pc = pcs()[webrtc_id]
    if pc.connectionState == "closed":
        return answer("failed", "connection_closed")
    try:
        await pc.addIceCandidate(candidate)
    except Exception as exc:  # as fastrtc answers it: the page only logs a candidate's failure
        log.info("connection %s: ICE candidate not added: %s", webrtc_id, exc)
        return answer("failed", str(exc))
    return answer("success")
