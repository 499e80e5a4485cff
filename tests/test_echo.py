"""The speaker-echo check (web/echo.py) on made-up calls: the agent's audio coming back through
the microphone is found, at about its delay; the caller's own speech, a steady tone and silence
are not."""

from __future__ import annotations

import numpy as np

from personaplex_demo.web.echo import EchoDetector, to_8k

RATE = 24000
CHUNK = 960  # 40 ms, as fastrtc hands the microphone to the handler


def babble(seconds: float, seed: int) -> np.ndarray:
    """Noise in syllables: loudness that comes and goes about four times a second, like speech."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    syllables = rng.uniform(0.0, 1.0, size=int(seconds * 4) + 2) ** 2
    loudness = np.repeat(syllables, RATE // 4)[:n] * (rng.uniform(size=n) > 0.1)
    return (0.3 * loudness * rng.standard_normal(n)).astype(np.float32)


def run_call(mic: np.ndarray, agent: np.ndarray, seconds: float = 10.0) -> EchoDetector:
    """Feed a detector as the handler does: agent frames of 80 ms as they are sent, microphone chunks
    of 40 ms as they arrive, on one clock."""
    detector = EchoDetector()
    for i in range(int(seconds / 0.04)):
        now = 100.0 + (i + 1) * 0.04
        if i % 2 == 1:
            detector.agent.add(agent[(i - 1) * CHUNK:(i + 1) * CHUNK], now)
        detector.caller.add(mic[i * CHUNK:(i + 1) * CHUNK], now)
        detector.check(now)
    return detector


def test_the_agent_coming_back_through_the_microphone_is_found():
    agent = babble(10, seed=1)
    for delay in (0.15, 0.35, 0.6):  # the way out and back, over loopback to a slow network
        shift = int(delay * RATE)
        mic = np.concatenate([np.zeros(shift, np.float32), 0.2 * agent[:-shift]])
        mic += 0.001 * np.random.default_rng(2).standard_normal(mic.size).astype(np.float32)
        detector = run_call(mic, agent)
        assert detector.detected, (delay, detector.score)
        assert abs(detector.delay_seconds - delay) <= 0.05, (delay, detector.delay_seconds)


def test_the_callers_own_speech_a_tone_and_silence_are_not_echo():
    agent = babble(10, seed=1)
    t = np.arange(10 * RATE) / RATE
    for name, mic in [("own speech", babble(10, seed=7)), ("another voice", babble(10, seed=8)),
                      ("tone", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)),
                      ("silence", np.zeros(10 * RATE, np.float32))]:
        detector = run_call(mic, agent)
        assert not detector.detected, (name, detector.score)


def test_independent_voices_are_not_taken_for_an_echo():
    agent = babble(14, seed=1)
    warned = [seed for seed in range(20, 50) if run_call(babble(14, seed=seed), agent, seconds=14).detected]
    assert not warned


def test_the_check_looks_at_8_khz():
    assert to_8k(np.arange(6, dtype=np.float32)).tolist() == [1.0, 4.0]
    assert to_8k(np.full(960, 16384, np.int16)).shape == (320,)
