"""The numbers every layer shares, defined once: the audio rate, the model's frame, the cards. A card
is also the id of the "initial" token that starts each stream: one past the largest real id.
"""

import math

import numpy as np

SAMPLE_RATE = 24_000  # Hz, mono
FRAME_SAMPLES = 1920  # one 80 ms model frame at SAMPLE_RATE
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
TEXT_CARD = 32_000  # text vocabulary size; also the text stream's initial token id
AUDIO_CARD = 2048  # codes per Mimi codebook; also each audio stream's initial token id
SOUND_DBFS = -40.0  # agent audio louder than this (RMS) is sound; below it, near silence


def frame_dbfs(pcm: np.ndarray) -> float:
    """The loudness of some float samples (RMS), in dB below full scale; -200 for silence."""
    power = float(np.mean(np.square(pcm, dtype=np.float64))) if pcm.size else 0.0
    return 10.0 * math.log10(power) if power > 1e-20 else -200.0
