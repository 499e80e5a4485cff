"""One call's own figures (web/call_figures.py): milestones, latency, late audio, packets, pacing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from personaplex_demo.frame import frame_dbfs
from personaplex_demo.serving.room import SlotOutput
from personaplex_demo.web.call_figures import FIGURES_SECONDS, CallFigures, read_packets

QUIET = np.zeros(1920, np.float32)
LOUD = np.full(1920, 0.1, np.float32)  # -20 dBFS


def out(pcm=QUIET, latency=None, drops=0) -> SlotOutput:
    return SlotOutput(pcm, "", 0, latency, drops)


def test_the_time_to_first_sound_is_split_at_each_milestone():
    f = CallFigures(100.0)
    for name, t in (("connected", 100.2), ("inputs", 100.3), ("live", 100.5)):
        f.mark(name, t)
    f.mark("live", 109.0)  # only the first time counts
    assert f.line() == "**This call** no sound from the agent yet"
    f.output(out(QUIET), 100.6)
    assert f.first_audio_seconds is None  # near silence is not the first sound
    f.output(out(LOUD), 100.7)
    assert f.first_audio_seconds == pytest.approx(0.7)
    assert f.parts() == pytest.approx({"connect": 0.2, "inputs": 0.1, "room": 0.2, "first_tick": 0.1,
                                       "first_sound": 0.1})
    assert frame_dbfs(LOUD) == pytest.approx(-20.0, abs=0.01) and frame_dbfs(QUIET) < -100


def test_latency_and_late_audio_count_only_once_the_caller_is_heard():
    f = CallFigures(0.0)
    f.mark("live", 0.0)
    for _ in range(3):  # before the caller's first frame: start-up, not late audio
        f.output(out(), 1.0)
    for i in range(20):
        f.output(out(LOUD, latency=0.1 + 0.01 * (i % 2), drops=i // 10), 2.0)
    f.output(out(), 3.0)
    f.output(out(), 3.1)
    assert f.underruns == 2 and f.heard == 22 and f.late_share == pytest.approx(2 / 22)
    assert f.input_drops == 1
    assert f.latency_ms(0.5) == pytest.approx(105.0)
    d = f.as_dict()
    assert d["latency_ms"]["answers"] == 20 and d["underruns"] == 2 and d["outputs"] == 25
    assert "9.1 % of your audio late" in f.line() and "1 frames dropped" in f.line()


def test_the_page_line_changes_at_once_for_the_first_sound_then_at_most_every_few_seconds():
    f = CallFigures(0.0)
    assert f.due(0.0) is None  # nothing to show before the call is live
    f.mark("live", 1.0)
    assert f.due(1.0) == "**This call** no sound from the agent yet"
    f.output(out(LOUD), 1.5)
    assert f.due(1.5) == "**This call** first sound after 1.50 s"
    f.output(out(LOUD, latency=0.1), 1.6)
    # A new figure: the round trip as the server sees it (the model's 160 ms and the room's 100 ms;
    # the page adds its browser's buffer in place of the last words), and the room's share.
    assert f.due(1.6).startswith("**This call** first sound after 1.50 s · round trip 260 ms + browser buffer · "
                                 "the room's share 100 ms")
    f.output(out(LOUD, latency=0.3), 2.0)
    assert f.due(2.0) is None  # changed, but not due yet
    later = 1.6 + FIGURES_SECONDS
    assert f.due(later) is not None and f.due(later + 1) is None and f.shown.startswith("**This call**")


class FakePC:
    def __init__(self, stats):
        self.stats = stats

    async def getStats(self):
        if self.stats is None:
            raise RuntimeError("closed")
        return {i: s for i, s in enumerate(self.stats)}


def test_packet_counts_come_from_the_peer_connection_both_ways():
    stats = [SimpleNamespace(type="inbound-rtp", kind="audio", packetsReceived=990, packetsLost=10),
             SimpleNamespace(type="outbound-rtp", kind="audio", packetsSent=500),
             SimpleNamespace(type="remote-inbound-rtp", kind="audio", packetsLost=5, roundTripTime=0.03),
             SimpleNamespace(type="transport", packetsSent=1, packetsReceived=1)]
    counts = asyncio.run(read_packets(FakePC(stats)))
    assert (counts.received, counts.lost_in, counts.sent, counts.lost_out) == (990, 10, 500, 5)
    assert counts.loss_in == pytest.approx(0.01) and counts.loss_out == pytest.approx(0.01)
    assert asyncio.run(read_packets(FakePC(None))) is None  # a closing connection: no figures, no error
    assert asyncio.run(read_packets(FakePC([]))) is None
    f = CallFigures(0.0)
    f.mark("live", 0.0)
    f.packets = counts
    assert "1.0 % packets lost in · 1.0 % packets lost out" in f.line()
    f.output(out(LOUD, latency=0.02), 1.0)
    assert "round trip 210 ms + browser buffer" in f.line()  # 160 + 20 + the network's 30 ms
    assert f.as_dict()["round_trip_ms"] == {"server_side": 210.0, "model_floor": 160.0, "network": 30.0}
