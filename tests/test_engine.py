"""The PCM engine: batch isolation, prefill paths, long calls, sampling and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_demo.engine.pcm import LockstepEngine, SamplingParams
from personaplex_demo.errors import AudioFormatError, CallerError, PersonaTooLongError, UnknownVoiceError
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from tests.support.stepwise import StepwiseCore

PERSONA = "You enjoy having a good conversation."
GREEDY = SamplingParams(greedy=True)


def make_engine(cache_dir, slots: int, **kw):
    return build_runtime(RuntimeOptions(model="tiny", slots=slots, cache_dir=cache_dir, **kw)).engine


def stepwise_engine(cache_dir) -> LockstepEngine:
    """One slot whose system prompt plays tick by tick, as the reference plays it."""
    e = make_engine(cache_dir, 1)
    return LockstepEngine(e.core.lm, e.mimi, e.tokenizer, e.voices, 1, core_class=StepwiseCore)


def speech_like(rng: np.random.Generator, n: int) -> np.ndarray:
    t = np.arange(n * 1920) / 24000
    f = rng.uniform(100, 400)
    x = 0.3 * np.sin(2 * np.pi * f * t) * (np.sin(2 * np.pi * 0.7 * t) > 0) + 0.02 * rng.standard_normal(t.size)
    return x.astype(np.float32).reshape(n, 1920)


def run_alone(engine, audio, voice, persona, sampling, slot=0):
    engine.start_session(slot, voice, persona, sampling)
    frames = []
    for x in audio:
        pcm = np.zeros((engine.batch_size, 1920), np.float32)
        pcm[slot] = x
        frames.append(engine.step(pcm).tokens[slot].copy())
    return np.stack(frames)


def test_batch_isolation_with_random_neighbours_and_recycles(tiny_cache_dir):
    rng = np.random.default_rng(7)
    audio = speech_like(rng, 60)
    alone = run_alone(make_engine(tiny_cache_dir, 1), audio, "NATM1", PERSONA, GREEDY)

    engine = make_engine(tiny_cache_dir, 4)
    voices = engine.voice_names
    words = ["pirate", "teacher", "astronaut", "chef", "banker", "calm", "loud"]

    def neighbour(slot):
        persona = " ".join(rng.choice(words, size=int(rng.integers(0, 12))))
        sampling = SamplingParams(seed=int(rng.integers(0, 2**31))) if rng.random() < 0.5 else GREEDY
        engine.start_session(slot, str(rng.choice(voices)), persona, sampling)

    for slot in (0, 1, 3):
        neighbour(slot)
    engine.start_session(2, "NATM1", PERSONA, GREEDY)
    frames = []
    for x in audio:
        if rng.random() < 0.15:  # a neighbour hangs up or a new caller arrives
            slot = int(rng.choice([0, 1, 3]))
            engine.end_session(slot) if rng.random() < 0.3 else neighbour(slot)
        pcm = rng.uniform(-0.5, 0.5, size=(4, 1920)).astype(np.float32)
        pcm[2] = x
        frames.append(engine.step(pcm).tokens[2].copy())
    np.testing.assert_array_equal(np.stack(frames), alone)


def test_a_call_is_token_exact_in_every_batch_bucket_and_when_its_row_moves_down(tiny_cache_dir):
    """One caller in an 8-slot room: its neighbours arrive and leave, so its ticks run in batches
    of 8, 4, 2 and 1 rows and its conversation moves down to lower rows as the room thins out;
    its tokens equal the same call alone in a 1-slot room, and its agent audio too (to float
    precision)."""
    rng = np.random.default_rng(5)
    audio = speech_like(rng, 70)
    alone_engine = make_engine(tiny_cache_dir, 1)
    alone_engine.start_session(0, "NATM1", PERSONA, GREEDY)
    alone = [alone_engine.step(x[None]) for x in audio]

    engine = make_engine(tiny_cache_dir, 8)
    assert engine.core.buckets == [1, 2, 4, 8]
    for slot in range(6):
        engine.start_session(slot, str(rng.choice(engine.voice_names)), "You are a chef.", SamplingParams(seed=slot))
    engine.start_session(6, "NATM1", PERSONA, GREEDY)
    assert engine.places.row_of[6] == 6
    leaving = {10: [0, 1, 2], 25: [3, 4], 40: [5]}  # 7, 4, 2, then 1 call left
    rows_run, rows_of_call = [], set()
    for i, x in enumerate(audio):
        for slot in leaving.get(i, []):
            engine.end_session(slot)
        if i == 55:  # a newcomer takes the lowest free row, beside the call
            engine.start_session(3, "NATF2", "", SamplingParams(seed=9))
        pcm = rng.uniform(-0.5, 0.5, size=(8, 1920)).astype(np.float32)
        pcm[6] = x
        out = engine.step(pcm)
        rows_run.append(out.rows)
        rows_of_call.add(engine.places.row_of[6])
        np.testing.assert_array_equal(out.tokens[6], alone[i].tokens[0], err_msg=f"tick {i}")
        # The decoder's sums run in another order at another batch size: equal to float precision.
        np.testing.assert_allclose(out.pcm[6], alone[i].pcm[0], atol=1e-5, err_msg=f"tick {i}")
        assert out.text[6] == alone[i].text[0]
    assert set(rows_run) == {8, 4, 2, 1} and rows_run[-1] == 2
    assert rows_of_call == {6, 0} and engine.places.row_of[3] == 1  # moved once, to the lowest free row


def test_fast_prefill_equals_stepwise_and_cache_is_reused(tiny_cache_dir):
    rng = np.random.default_rng(3)
    audio = speech_like(rng, 40)
    stepwise = stepwise_engine(tiny_cache_dir)
    stepwise.start_session(0, "VARF3", PERSONA, GREEDY)
    warm = 0
    while not stepwise.core.is_live(0):
        stepwise.step(np.zeros((1, 1920), np.float32))
        warm += 1
    assert warm == 1 + stepwise.voices.load("VARF3").length + 12 + len(stepwise.persona_tokens(PERSONA))
    ref = np.stack([stepwise.step(x[None]).tokens[0].copy() for x in audio])

    fast = make_engine(tiny_cache_dir, 2)
    got = run_alone(fast, audio, "VARF3", PERSONA, GREEDY, slot=1)
    np.testing.assert_array_equal(got, ref)
    stats = fast.core.prefixes.stats
    assert stats.misses == 1 and stats.hits == 0
    again = run_alone(fast, audio, "VARF3", PERSONA, GREEDY, slot=0)
    assert stats.hits == 1 and stats.prefills == 1
    np.testing.assert_array_equal(again, ref)


def test_call_longer_than_the_context_keeps_running(tiny_cache_dir):
    engine = make_engine(tiny_cache_dir, 2, context=16)
    engine.start_session(0, "NATF2", PERSONA, SamplingParams(seed=5))
    rng = np.random.default_rng(0)
    live_frames = 0
    for x in speech_like(rng, 80):  # 80 ticks through a 16-frame window
        out = engine.step(np.stack([x, np.zeros(1920, np.float32)]))
        assert np.isfinite(out.pcm).all()
        live_frames += int(out.live[0])
    assert live_frames == 80 and int(engine.core.state.kv.end[0]) > 16 * 4


def test_seed_makes_a_call_reproducible_and_knobs_matter(tiny_cache_dir):
    engine = make_engine(tiny_cache_dir, 1)
    audio = speech_like(np.random.default_rng(1), 30)
    a = run_alone(engine, audio, "NATF2", PERSONA, SamplingParams(seed=11))
    b = run_alone(engine, audio, "NATF2", PERSONA, SamplingParams(seed=11))
    c = run_alone(engine, audio, "NATF2", PERSONA, SamplingParams(seed=12))
    d = run_alone(engine, audio, "NATF2", PERSONA, SamplingParams(seed=11, text_top_k=1, audio_top_k=1))
    g = run_alone(engine, audio, "NATF2", PERSONA, GREEDY)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # top-k 1 is greedy whatever the seed: the caller's knobs are honoured.
    np.testing.assert_array_equal(d, g)


def test_bad_requests_are_specific_errors(tiny_cache_dir):
    engine = make_engine(tiny_cache_dir, 1)
    with pytest.raises(UnknownVoiceError, match="NATF2"):
        engine.validate_request("NOPE", PERSONA, GREEDY)
    with pytest.raises(UnknownVoiceError):
        engine.validate_request("../../x", PERSONA, GREEDY)
    with pytest.raises(PersonaTooLongError, match=f"limit is {engine.max_persona_tokens} tokens"):
        engine.validate_request("NATF2", "word " * 700, GREEDY)
    with pytest.raises(PersonaTooLongError, match="characters"):
        engine.validate_request("NATF2", "x" * 100_000, GREEDY)
    with pytest.raises(CallerError, match="control characters"):
        engine.validate_request("NATF2", "hello\x00world\x1b[31m", GREEDY)
    with pytest.raises(CallerError, match="not valid Unicode"):  # JSON's "\ud800", which the tokenizer cannot take
        engine.validate_request("NATF2", "hello \ud800", GREEDY)
    with pytest.raises(CallerError, match="text_temperature"):
        engine.validate_request("NATF2", PERSONA, SamplingParams(text_temperature=float("nan")))
    engine.validate_request("NATF2", "", GREEDY)  # an empty persona is allowed
    with pytest.raises(AudioFormatError, match="1920"):
        engine.step(np.zeros((1, 960), np.float32))


def test_nan_and_clipped_audio_are_sanitised_without_touching_neighbours(tiny_cache_dir):
    audio = speech_like(np.random.default_rng(2), 20)
    clean = make_engine(tiny_cache_dir, 2)
    clean.start_session(0, "NATF2", PERSONA, GREEDY)
    clean.start_session(1, "NATM0", "", GREEDY)
    dirty = make_engine(tiny_cache_dir, 2)
    dirty.start_session(0, "NATF2", PERSONA, GREEDY)
    dirty.start_session(1, "NATM0", "", GREEDY)
    for i, x in enumerate(audio):
        noisy = np.full(1920, np.nan if i % 2 else 7.0, np.float32)
        noisy[::3] = np.inf
        a = clean.step(np.stack([x, np.zeros(1920, np.float32)]))
        b = dirty.step(np.stack([x, noisy]))
        np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
        np.testing.assert_array_equal(a.pcm[0], b.pcm[0])
        assert np.isfinite(b.pcm).all()
    assert dirty.sanitized_frames == len(audio)


def test_agent_audio_saturates_at_full_scale(tiny_cache_dir):
    # fastrtc turns float32 into int16 by scaling alone, so anything past ±1 would wrap into clicks.
    engine = make_engine(tiny_cache_dir, 1)
    decode = engine._decode
    engine._decode = lambda codes: 50.0 * decode(codes)
    engine.start_session(0, "NATF2", PERSONA, GREEDY)
    loud = 0
    for x in speech_like(np.random.default_rng(3), 12):
        pcm = engine.step(x[None]).pcm
        assert np.abs(pcm).max() <= 1.0
        loud += int((np.abs(pcm) == 1.0).sum())
    assert loud > 0  # the louder decoder really did go past full scale


def test_attending_only_the_filled_ring_gives_the_same_tokens(tiny_cache_dir):
    """The fast path that attends only the filled part of the KV rings (bucketed by length)
    against the whole ring, with callers of different ages, a recycle, and rows that wrap."""
    rng = np.random.default_rng(11)
    audio = speech_like(rng, 340)
    runs, seen = {}, {}
    for fast in (True, False):
        engine = make_engine(tiny_cache_dir, 3, context=300)
        engine.core.attend_filled = fast
        buckets = set()
        engine.start_session(0, "NATF2", PERSONA, GREEDY)
        engine.start_session(1, "VARM1", "", SamplingParams(seed=5))
        frames = []
        for i, x in enumerate(audio):
            if i == 40:
                engine.start_session(2, "NATM0", "You are a chef.", SamplingParams(seed=9))
            if i == 200:
                engine.end_session(1)
                engine.start_session(1, "NATF0", PERSONA, GREEDY)  # a young row beside old ones
            buckets.add(engine.core.visible_slots())
            pcm = np.stack([x, x[::-1].copy(), 0.5 * x])
            frames.append(engine.step(pcm).tokens.copy())
        runs[fast], seen[fast] = np.stack(frames), buckets
    assert seen[True] == {256, None} and seen[False] == {None}  # both paths really ran
    np.testing.assert_array_equal(runs[True], runs[False])
