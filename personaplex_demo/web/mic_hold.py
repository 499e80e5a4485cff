"""A waiting caller's microphone, held: nothing of its audio is heard, so the page stops sending it and
the server stops decoding it (docs/serving.md § The room contract). The handler says `HOLD` or `SEND` as
a fastrtc "log" data-channel message, which fastrtc's page ignores and `MIC_HOLD_SCRIPT` acts on."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from ..rtc.patches import receive_audio
from .assets import page_script

log = logging.getLogger(__name__)

# Audio already on its way when the hold began (in the network, the jitter buffer, the decoder's
# queue) may still be decoded this long after it; it is not counted as decoded while held.
IN_FLIGHT_SECONDS = 0.5

HOLD = "personaplex:hold-microphone"  # the call waits: send no audio
SEND = "personaplex:send-microphone"  # the call's slot is being prepared: send it again


class MicHold:
    """One call's side: hold the microphone while the call waits, send it from its prefill on."""

    def __init__(self) -> None:
        self.held = False
        self.held_since = 0.0
        self.decoded_held = 0  # the caller's frames decoded while held: none, where the peer is known

    def decoded(self) -> None:
        """One frame of the caller's audio was decoded (counted when it came in a hold)."""
        if self.held and time.monotonic() - self.held_since > IN_FLIGHT_SECONDS:
            self.decoded_held += 1

    def set(self, held: bool, channel: Any, peers: Callable[[str], Any] | None, webrtc_id: str | None) -> None:
        """Hold (True) or release the microphone; tells the page once per change, and switches the
        peer's audio receiver where the peer is known."""
        if held == self.held:
            return
        self.held, self.held_since = held, time.monotonic()
        if peers and webrtc_id and (pc := peers(webrtc_id)) is not None:
            receive_audio(pc, not held)
        if channel is not None:
            try:
                channel.send(json.dumps({"type": "log", "data": HOLD if held else SEND}))
            except Exception as exc:  # a channel closing under us: the call ends anyway
                log.debug("could not tell the page to %s its microphone: %s", "hold" if held else "send", exc)


# Wraps RTCPeerConnection as the page's other script does (assets/round_trip.js): each new
# connection's "text" data channel is listened to for HOLD and SEND.
MIC_HOLD_SCRIPT = page_script("mic_hold.js", HOLD=HOLD, SEND=SEND)
