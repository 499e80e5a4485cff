"""The engine's own causal delay (docs/engine.md § Causal delay), measured on the lockstep engine
as the app runs it, and the loopback engine that the round-trip benchmarks use answers with it."""

from __future__ import annotations

from bench.causal_delay import pcm_delays
from bench.loopback_app import LOOPBACK_FRAMES, loop_back
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime


def test_an_input_frame_first_changes_the_next_steps_output_from_its_first_sample(tiny_cache_dir):
    engine = build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir)).engine
    # Never the same step's output (the frame reaches the model one step later); the next one's
    # from its first sample on (the codec adds no look-ahead of its own), unless no token flips
    # that early (greedy decoding can pick the same tokens for a different input).
    found = pcm_delays(engine, trials=8)
    assert None not in found and all(steps >= 1 and sample == 0 for steps, sample in found), found
    assert min(found) == (1, 0) and found.count((1, 0)) >= len(found) // 2, found


def test_the_loopback_engine_answers_with_exactly_that_delay(tiny_cache_dir):
    engine = build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir)).engine
    loop_back(engine)
    assert pcm_delays(engine, trials=3) == [(LOOPBACK_FRAMES, 0)] * 3 == [(1, 0)] * 3
