"""Trickled ICE candidates: every browser's format, and those that come before their offer."""

from __future__ import annotations

import asyncio
import json

from personaplex_demo.rtc import candidates
from personaplex_demo.rtc.candidates import accepting_candidates

FIREFOX = "candidate:0 1 UDP 2122187007 192.0.2.2 47023 typ host"  # the eight fields, nothing more
CHROMIUM = ("candidate:842163049 1 udp 1677729535 203.0.113.7 61447 typ srflx raddr 192.168.1.4 rport 61447 "
            "generation 0 ufrag sZsL network-id 1 network-cost 10")


class FakePeer:
    def __init__(self) -> None:
        self.remoteDescription = None
        self.connectionState = "new"
        self.added = []

    async def addIceCandidate(self, candidate) -> None:
        self.added.append(candidate)


def status(response) -> tuple[str, str | None]:
    body = json.loads(response.body)
    return body["status"], body.get("meta", {}).get("error")


async def test_firefoxs_and_chromiums_candidates_are_added_and_one_before_its_offer_waits_for_it(monkeypatch):
    monkeypatch.setattr(candidates, "WAIT_SECONDS", 2.0)
    pcs: dict[str, FakePeer] = {}
    offers = []

    async def handle_offer(body, set_outputs):
        offers.append(body)
        return {"type": "answer"}

    handle = accepting_candidates(lambda: pcs, handle_offer)
    early = asyncio.ensure_future(handle({"type": "ice-candidate", "webrtc_id": "a",
                                          "candidate": {"candidate": FIREFOX, "sdpMid": "0"}}, None))
    await asyncio.sleep(0.1)
    assert not early.done()  # its connection's offer has not been taken yet
    pcs["a"] = peer = FakePeer()
    await asyncio.sleep(0.1)
    assert not early.done()  # known, but the offer's remote description is not set yet
    peer.remoteDescription = object()
    assert status(await early) == ("success", None)
    later = await handle({"type": "ice-candidate", "webrtc_id": "a",
                          "candidate": {"candidate": CHROMIUM, "sdpMLineIndex": 0}}, None)
    assert status(later) == ("success", None)
    assert [(c.ip, c.port, c.type, c.protocol, c.sdpMid) for c in peer.added] == [
        ("192.0.2.2", 47023, "host", "UDP", "0"), ("203.0.113.7", 61447, "srflx", "udp", None)]
    assert peer.added[1].relatedAddress == "192.168.1.4"
    # The end of the candidates, and one that cannot be read: answered, nothing added.
    end = await handle({"type": "ice-candidate", "webrtc_id": "a", "candidate": {"candidate": ""}}, None)
    bad = await handle({"type": "ice-candidate", "webrtc_id": "a", "candidate": {"candidate": "candidate:x 1"}}, None)
    assert status(end) == ("success", None) and status(bad) == ("failed", "invalid_candidate_format")
    assert len(peer.added) == 2
    # A connection that never comes, and one that closed.
    assert status(await handle({"type": "ice-candidate", "webrtc_id": "b", "candidate": {"candidate": FIREFOX}},
                               None)) == ("failed", "unknown_connection")
    peer.connectionState = "closed"
    assert status(await handle({"type": "ice-candidate", "webrtc_id": "a", "candidate": {"candidate": FIREFOX}},
                               None)) == ("failed", "connection_closed")
    # Offers themselves go on to fastrtc's handler.
    assert await handle({"type": "offer", "webrtc_id": "c", "sdp": "v=0"}, None) == {"type": "answer"}
    assert [o["webrtc_id"] for o in offers] == ["c"]
