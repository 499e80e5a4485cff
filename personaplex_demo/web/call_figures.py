"""One call's own figures, as its caller meets them: the time to first sound and where it went, the
room's latency for this call, and the audio lost or late on the way (docs/serving.md § Figures per call).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..frame import SOUND_DBFS, frame_dbfs
from ..serving.room import SlotOutput

log = logging.getLogger(__name__)

FIGURES_SECONDS = 15.0  # the page's line of call figures changes at most this often
# The model's own part of a round trip: a sound at a frame's start is answered once the next frame is
# complete (docs/engine.md § Causal delay).
MODEL_FLOOR_MS = 160.0
TRIP_PENDING = " + browser buffer"  # what the page's script replaces once it has its own figure
LATENCY_WINDOW = 250  # the latest answers (20 s of them) whose latencies the figures report

# The start of a call, in order; each part of the time to first audio ends at one of them.
MILESTONES = ("offer", "connected", "inputs", "live", "first_output", "first_sound")
PARTS = (
    "connect",  # the peer connection (ICE, DTLS and the data channel) after the offer arrived
    "inputs",  # the page's voice and persona reaching the call
    "room",  # the room: the queue, then the prefill of the voice and persona
    "first_tick",  # the first tick after the call went live
    "first_sound",  # the first outputs that were near silence
)


@dataclass
class PacketCounts:
    """RTP packets of the call's audio each way, from the server's peer connection."""

    received: int = 0  # the caller's packets that arrived
    lost_in: int = 0  # the caller's packets that never arrived
    sent: int = 0  # the agent's packets sent
    lost_out: int = 0  # of those, lost on the way, as the caller's RTCP reports say
    round_trip_time: float | None = None  # seconds there and back, from the caller's RTCP reports

    @property
    def loss_in(self) -> float | None:
        return self.lost_in / (self.received + self.lost_in) if self.received + self.lost_in > 0 else None

    @property
    def loss_out(self) -> float | None:
        return self.lost_out / self.sent if self.sent > 0 else None


async def read_packets(pc) -> PacketCounts | None:
    """The audio packet counts of an aiortc peer connection, or None when it has none yet."""
    try:
        report = await pc.getStats()
    except Exception:  # noqa: BLE001 -- a closing connection has no figures; the call does not care
        log.debug("getStats failed", exc_info=True)
        return None
    counts, seen = PacketCounts(), False
    for stats in report.values():
        if getattr(stats, "kind", "audio") != "audio":
            continue
        match stats.type:
            case "inbound-rtp":
                counts.received += stats.packetsReceived
                counts.lost_in += max(0, stats.packetsLost)
                seen = True
            case "outbound-rtp":
                counts.sent += stats.packetsSent
                seen = True
            case "remote-inbound-rtp":
                counts.lost_out += max(0, stats.packetsLost)
                if getattr(stats, "roundTripTime", None) is not None:
                    counts.round_trip_time = stats.roundTripTime
    return counts if seen else None


class CallFigures:
    """The figures of one call, on the server's monotonic clock. Used from the call's event loop only."""

    def __init__(self, offer_at: float) -> None:
        self.at: dict[str, float] = {"offer": offer_at}
        self.queued = False  # whether the call waited in the queue for a slot
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.outputs = 0
        self.heard = 0  # outputs since the caller's first frame reached the room
        self.underruns = 0  # outputs answering no input (it came late or not at all): silence stood in
        self.input_drops = 0  # input frames the room dropped (too many waiting, or a resync)
        self.packets: PacketCounts | None = None
        self._packets_at: float | None = None  # when the packet counts were last asked for
        self._reading: asyncio.Task | None = None  # also a reference, so it is not collected mid-read
        self._shown_at: float | None = None
        self.shown = ""  # the line the page shows
        self._shown_shape: tuple[bool, ...] = ()

    def mark(self, milestone: str, now: float) -> None:
        """Note `milestone` (one of MILESTONES) at `now`, the first time only."""
        self.at.setdefault(milestone, now)

    def output(self, out: SlotOutput, now: float) -> bool:
        """Read one output the room sent to this call; True when it is the call's first sound."""
        self.mark("first_output", now)
        self.outputs += 1
        self.input_drops = max(self.input_drops, out.input_drops)  # a running count
        if out.latency is not None:
            self.latencies.append(out.latency)
        elif self.heard:  # before the caller's first frame, silence standing in is the start
            self.underruns += 1
        if self.heard or out.latency is not None:
            self.heard += 1
        if "first_sound" not in self.at and frame_dbfs(out.pcm) > SOUND_DBFS:
            self.mark("first_sound", now)
            return True
        return False

    def read_packets_soon(self, peers: Callable[[str], Any] | None, webrtc_id: str | None,
                          now: float) -> None:
        """With the first output, then every FIGURES_SECONDS: read the packet counts of the call's aiortc
        peer (`peers(webrtc_id)`) into `packets`, in the background."""
        if not (peers and webrtc_id) or (self._reading is not None and not self._reading.done()) or (
                self._packets_at is not None and now - self._packets_at < FIGURES_SECONDS - 1.0):
            return
        self._packets_at = now
        if pc := peers(webrtc_id):
            self._reading = asyncio.create_task(self._read_packets(pc))

    async def _read_packets(self, pc) -> None:
        self.packets = await read_packets(pc) or self.packets

    # ---- what they add up to -------------------------------------------------------------------

    @property
    def first_audio_seconds(self) -> float | None:
        """From the offer reaching the server to the first agent sound it sent."""
        first = self.at.get("first_sound")
        return None if first is None else first - self.at["offer"]

    def parts(self) -> dict[str, float]:
        """The time to first audio, part by part (PARTS), as far as the call got."""
        done = [(m, self.at[m]) for m in MILESTONES if m in self.at]
        names = dict(zip(MILESTONES[1:], PARTS, strict=True))
        return {names[m]: round(t - prev, 4) for (_, prev), (m, t) in zip(done, done[1:], strict=False)
                if m in names}

    def first_sound_text(self) -> str:
        """For the log: "0.34 s after the offer (connect 0.150, inputs 0.040, ...)"."""
        parts = ", ".join(f"{k} {v:.3f}" for k, v in self.parts().items())
        return f"{self.first_audio_seconds:.2f} s after the offer ({parts})"

    def round_trip_ms(self, room: float | None = None) -> float | None:
        """Mouth to ear as the server sees this call: the model's floor, the room's latency p50 (`room`,
        when the caller has it at hand) and the network's round trip; the page adds its jitter buffer."""
        room = room if room is not None else self.latency_ms(0.5)
        if room is None:
            return None
        rtt = self.packets.round_trip_time if self.packets is not None else None
        return MODEL_FLOOR_MS + room + 1e3 * (rtt or 0.0)

    def latency_ms(self, q: float) -> float | None:
        return 1e3 * float(np.quantile(np.fromiter(self.latencies, float), q)) if self.latencies else None

    @property
    def late_share(self) -> float | None:
        """Of the outputs since the caller's first frame, the share with no input to answer."""
        return self.underruns / self.heard if self.heard else None

    def as_dict(self) -> dict:
        """For the call's transcript JSON."""
        first = self.first_audio_seconds
        packets = self.packets
        return {
            "first_audio_seconds": None if first is None else round(first, 4),
            "first_audio_parts_seconds": self.parts(),
            "queued": self.queued,
            "latency_ms": {"p50": _round(self.latency_ms(0.5)), "p95": _round(self.latency_ms(0.95)),
                           "answers": len(self.latencies)},
            "round_trip_ms": {"server_side": _round(self.round_trip_ms()), "model_floor": MODEL_FLOOR_MS,
                              "network": _round(None if packets is None or packets.round_trip_time is None
                                                else 1e3 * packets.round_trip_time)},
            "outputs": self.outputs,
            "underruns": self.underruns,
            "input_drops": self.input_drops,
            "packets": None if packets is None else {k: v for k, v in asdict(packets).items() if k != "round_trip_time"},
        }

    def line(self) -> str:
        """This call's figures in a few words, for the page ("" until the call is live)."""
        if "live" not in self.at:
            return ""
        first = self.first_audio_seconds
        bits = [f"first sound after {first:.2f} s" if first is not None else "no sound from the agent yet"]
        if (p50 := self.latency_ms(0.5)) is not None:
            # The page's script adds its jitter buffer to the first figure (assets/round_trip.js).
            bits.append(f"round trip {self.round_trip_ms(p50):.0f} ms{TRIP_PENDING} · the room's share {p50:.0f} ms")
        lost = []
        if (late := self.late_share) is not None:
            lost.append(f"{100 * late:.1f} % of your audio late")
        if self.input_drops:
            lost.append(f"{self.input_drops} frames dropped")
        if self.packets is not None:
            for name, share in (("in", self.packets.loss_in), ("out", self.packets.loss_out)):
                if share is not None:
                    lost.append(f"{100 * share:.1f} % packets lost {name}")
        return "**This call** " + " · ".join(bits + lost)

    def due(self, now: float) -> str | None:
        """The line for the page when it should change now, else None: at once when it has news (the
        first sound, a figure shown for the first time), otherwise at most every FIGURES_SECONDS."""
        # Which figures there are, cheap to compare (emit asks for every frame): the line is built only when due.
        shape = ("live" in self.at, "first_sound" in self.at, bool(self.latencies), bool(self.heard),
                 bool(self.input_drops), self.packets is not None)
        news = shape != self._shown_shape
        if not news and self._shown_at is not None and now - self._shown_at < FIGURES_SECONDS:
            return None
        line = self.line()
        if not line or line == self.shown:
            return None
        self.shown, self._shown_at, self._shown_shape = line, now, shape
        return line


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
