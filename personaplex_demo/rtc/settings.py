"""Settings every process that holds WebRTC peers applies: the app's, and each media worker's."""

from __future__ import annotations

import os

from .ice import LOOPBACK_VAR


def apply_media_settings() -> None:
    """The app's WebRTC settings, in every process that holds peers (rtc/patches.py). A media worker reads
    PERSONAPLEX_LOOPBACK_ICE=1 (WebRTC on 127.0.0.1 only) from the environment it inherits."""
    from .patches import (
        install_audio_level,
        install_ice_settings,
        install_jitter_buffer,
        install_loop_codecs,
        install_output_pacing,
        install_packet_encoder,
    )

    install_ice_settings(os.environ.get(LOOPBACK_VAR) == "1")
    install_packet_encoder()  # agent audio in 40 ms Opus packets, each encoded as soon as its audio is there
    install_loop_codecs()  # Opus encoded and decoded on the event loop: no thread hop per packet
    install_audio_level()  # each packet's RTP audio level, the same value without a Python loop
    install_jitter_buffer()  # the callers' packets released as they arrive, never stuck behind a loss
    install_output_pacing()  # agent packets 40 ms apart, with no anchor that a late first frame sets
