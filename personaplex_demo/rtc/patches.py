"""Every change this app makes to a pinned library, in one place. Each replaces a module attribute or
setting the library looks up at run time (or one fastrtc instance, never its class), so the app needs no
fork; `written_for` warns when the installed version is not the one a patch was read against."""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from typing import Any

from .audio import (
    ArrivalJitterBuffer,
    PacedAudioCallback,
    PacketOpusEncoder,
    agent_audio_worker,
    answering_with_packet_time,
    audio_level_dbov,
    make_loop_decoder_worker,
    next_encoded_frame,
)
from .candidates import accepting_candidates
from .ice import LOOPBACK_VAR

log = logging.getLogger(__name__)

# The versions requirements.txt and requirements-dev.txt pin, which every patch here was read against.
WRITTEN_FOR = {"aiortc": "1.16.0", "aioice": "0.13.0", "gradio": "5.50.0", "fastrtc": "0.0.34"}

# Gradio's record of past events: how many finished entries it keeps (docs/design-notes.md § Gradio event log).
KEEP_EVENTS = 512
_FINISHED = ("success", "failed", "cancelled")
_NEVER = 10**12  # events between two summaries: never again


@functools.cache
def written_for(package: str) -> bool:
    """True if the installed `package` is the version its patches were written for; else a warning, once."""
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        installed = "none"
    if installed != WRITTEN_FOR[package]:
        log.warning("%s %s is installed; this app's patches of it were written for %s (rtc/patches.py)",
                    package, installed, WRITTEN_FOR[package])
        return False
    return True


def _replace(owner: Any, name: str, package: str, replacement: Any) -> None:
    """`owner.<name>`, which `package` looks up there at run time, replaced by `replacement`; once only."""
    written_for(package)
    if getattr(getattr(owner, name), "patched_here", False):
        return
    replacement.patched_here = True
    setattr(owner, name, replacement)


# ---- aiortc ---------------------------------------------------------------------------------------


def install_audio_level() -> None:
    """aiortc's senders in this process compute each packet's audio level with `audio_level_dbov`."""
    import aiortc.rtp as rtp

    _replace(rtp, "compute_audio_level_dbov", "aiortc", audio_level_dbov)


def install_packet_encoder() -> None:
    """aiortc's senders in this process encode Opus in `PACKET_MS` packets (aiortc picks an encoder per
    negotiated codec through `get_encoder`); other codecs keep aiortc's own encoders."""
    import aiortc.rtcrtpsender as sender

    original = sender.get_encoder

    def get_encoder(codec):
        return PacketOpusEncoder() if codec.mimeType.lower() == "audio/opus" else original(codec)

    _replace(sender, "get_encoder", "aiortc", get_encoder)


def install_loop_codecs() -> None:
    """aiortc's audio senders in this process encode on the event loop, and its audio receivers decode
    there, instead of in a thread each (rtc/audio.py `next_encoded_frame`, `make_loop_decoder_worker`)."""
    import aiortc.rtcrtpreceiver as receiver
    from aiortc.rtcrtpsender import RTCRtpSender

    _replace(RTCRtpSender, "_next_encoded_frame", "aiortc", next_encoded_frame)
    _replace(receiver, "decoder_worker", "aiortc", make_loop_decoder_worker())


def install_jitter_buffer() -> None:
    """aiortc's receivers in this process use `ArrivalJitterBuffer` (by the name `JitterBuffer`)."""
    import aiortc.rtcrtpreceiver as receiver

    _replace(receiver, "JitterBuffer", "aiortc", ArrivalJitterBuffer)


def install_output_pacing() -> None:
    """fastrtc's connections in this process send audio through `PacedAudioCallback` (by the name
    `AudioCallback` in `webrtc_connection_mixin`)."""
    import fastrtc.webrtc_connection_mixin as mixin

    _replace(mixin, "AudioCallback", "fastrtc", PacedAudioCallback)


def install_agent_frames() -> None:
    """fastrtc's outgoing audio tracks in this process turn a handler's audio into frames with
    `agent_audio_worker` (by the name `player_worker_decode` in `fastrtc.tracks`): s16 mono, as the
    Opus encoder takes it, instead of float stereo resampled twice."""
    import fastrtc.tracks as tracks

    _replace(tracks, "player_worker_decode", "fastrtc", agent_audio_worker)


def receive_audio(pc: Any, on: bool) -> bool:
    """Turn the decoding of the audio that `pc`'s peer sends on or off; False where `pc` has no audio
    receiver to switch. Off, aiortc 1.16's own switch (`RTCRtpReceiver._enabled`) drops each RTP packet
    after SRTP, before the jitter buffer and decoder: a queued caller costs almost nothing. The browser
    is not told and keeps sending, so the audio is there again at once when turned back on."""
    written_for("aiortc")
    receivers = [t.receiver for t in pc.getTransceivers() if t.kind == "audio"]
    for receiver in receivers:
        if not hasattr(receiver, "_enabled"):
            return False
        receiver._enabled = on
    return bool(receivers)


# ---- fastrtc (one component or host instance, never the class) -----------------------------------


def answer_offers(owner: Any) -> None:
    """`owner.handle_offer` (fastrtc's, on the page's WebRTC component or a media worker's host) wrapped so
    that its SDP answers ask the browser for `PACKET_MS` packets, and every browser's trickled ICE
    candidates reach its peer connections, even one sent before its offer was taken (rtc/candidates.py)."""
    written_for("fastrtc")
    written_for("aiortc")
    owner.handle_offer = accepting_candidates(lambda: owner.pcs, answering_with_packet_time(owner.handle_offer))


def route_offers(rtc: Any, offer: Any, set_input: Any) -> None:
    """The page's WebRTC component sends its offers (and trickled candidates) to `offer` and its inputs
    to `set_input` instead of answering them itself (orchestration/media_workers.py)."""
    written_for("fastrtc")

    async def routed_offer(body):
        return await offer(body)

    routed_offer._is_server_fn = True  # what gradio's @server marks: callable from the page
    rtc.offer = routed_offer
    rtc.set_input = set_input


# ---- aioice ---------------------------------------------------------------------------------------


def loopback_host_addresses(use_ipv4: bool = True, use_ipv6: bool = False) -> list[str]:
    """In place of `aioice.ice.get_host_addresses`, which skips 127.0.0.1: ICE candidates on loopback only."""
    return ["127.0.0.1"]


def install_ice_settings(loopback: bool) -> None:
    """aioice in this process: consent checks every second, a peer gone after 4 missed (about 4 s instead
    of about 30, so a closed tab's slot frees quickly); with `loopback`, candidates on 127.0.0.1 only."""
    import aioice.ice

    written_for("aioice")
    if loopback:
        aioice.ice.get_host_addresses = loopback_host_addresses
    aioice.ice.CONSENT_INTERVAL, aioice.ice.CONSENT_FAILURES = 1, 4


# ---- Gradio ---------------------------------------------------------------------------------------


class BoundedEventLog(dict):
    """A dict that, past twice its limit, forgets its oldest finished entries. Entries of events
    still queued or running stay: Gradio updates them when they finish."""

    def __init__(self, limit: int, entries: dict[str, Any] | None = None) -> None:
        super().__init__(entries or {})
        self.limit = limit

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > 2 * self.limit:
            excess = len(self) - self.limit
            finished = [k for k, entry in self.items() if isinstance(entry, dict) and entry.get("status") in _FINISHED]
            for k in finished[:excess]:  # insertion order: the oldest first
                del self[k]


def bound_event_log(demo: Any, limit: int = KEEP_EVENTS) -> None:
    """Bound `demo`'s queue record (Gradio 5.50's `Queue.event_analytics`, one entry per event ever run)
    and turn off the pandas summary of it built after every event: on a server that runs for days both
    grow without end (docs/design-notes.md § Gradio event log). A Gradio without that record is left alone."""
    written_for("gradio")
    queue = getattr(demo, "_queue", None)
    entries = getattr(queue, "event_analytics", None)
    if not isinstance(entries, dict) or not hasattr(queue, "ANAYLTICS_CACHE_FREQUENCY"):
        log.warning("this Gradio's queue keeps no event_analytics record; not bounding it")
        return
    queue.event_analytics = BoundedEventLog(limit, entries)
    queue.ANAYLTICS_CACHE_FREQUENCY = _NEVER  # (Gradio's spelling) no pandas table after each event


def apply_media_settings() -> None:
    """The app's WebRTC settings, in every process that holds peers: the app's and each media worker's
    (which reads PERSONAPLEX_LOOPBACK_ICE=1 from the environment it inherits)."""
    install_ice_settings(os.environ.get(LOOPBACK_VAR) == "1")
    install_packet_encoder()  # agent audio in 40 ms Opus packets, each encoded as soon as its audio is there
    install_loop_codecs()  # Opus encoded and decoded on the event loop: no thread hop per packet
    install_audio_level()  # each packet's RTP audio level, the same value without a Python loop
    install_jitter_buffer()  # the callers' packets released as they arrive, never stuck behind a loss
    install_output_pacing()  # agent packets 40 ms apart, with no anchor that a late first frame sets
    install_agent_frames()  # the agent's audio cut into s16 mono packets, not resampled to stereo and back
