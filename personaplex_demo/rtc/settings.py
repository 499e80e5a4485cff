"""Settings every process that holds WebRTC peers applies: the app's, and each media worker's."""

from __future__ import annotations

import os

from .ice import LOOPBACK_VAR


def loopback_requested() -> bool:
    """PERSONAPLEX_LOOPBACK_ICE=1: WebRTC stays on 127.0.0.1 (tests; browser and server on one
    machine without a network)."""
    return os.environ.get(LOOPBACK_VAR) == "1"


def loopback_host_addresses(use_ipv4: bool = True, use_ipv6: bool = False) -> list[str]:
    """In place of `aioice.ice.get_host_addresses`, which skips 127.0.0.1: ICE candidates on
    loopback only (tests, benchmarks, and offline use on one machine)."""
    return ["127.0.0.1"]


def apply_media_settings(loopback: bool) -> None:
    import aioice.ice

    from .audio import install_audio_level, install_jitter_buffer, install_packet_encoder

    if loopback:
        aioice.ice.get_host_addresses = loopback_host_addresses
    # Notice a closed tab in ~4 s instead of ~30 s, so its slot frees quickly.
    aioice.ice.CONSENT_INTERVAL, aioice.ice.CONSENT_FAILURES = 1, 4
    install_packet_encoder()  # agent audio in 40 ms Opus packets: half the per-packet work per caller
    install_audio_level()  # each packet's RTP audio level, the same value without a Python loop
    install_jitter_buffer()  # the callers' audio held back 80 ms, not 4 packets (160 ms at 40 ms)
