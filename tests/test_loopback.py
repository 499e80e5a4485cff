"""The loopback engine that measures the round trip through the browser (bench/loopback_app.py)."""

from __future__ import annotations

import numpy as np

from bench.loopback_app import LOOPBACK_FRAMES, loop_back
from personaplex_demo.call_settings import SamplingParams
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime


def test_each_caller_hears_their_own_input_two_frames_later(tiny_cache_dir):
    engine = build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir)).engine
    loop_back(engine)
    engine.start_session(0, "NATF2", "", SamplingParams(seed=1))
    frames = [np.full((2, engine.frame_size), 0.01 * (k + 1), np.float32) for k in range(6)]
    while not engine.core.is_live(0):  # the prompt plays first
        engine.step(np.zeros((2, engine.frame_size), np.float32))
    outs = [engine.step(f).pcm for f in frames]
    for k in range(LOOPBACK_FRAMES):
        assert not outs[k][0].any()  # the first 160 ms: silence
    for k in range(LOOPBACK_FRAMES, len(frames)):
        np.testing.assert_array_equal(outs[k][0], frames[k - LOOPBACK_FRAMES][0])
    assert not np.concatenate(outs)[1::2].any()  # row 1 has no session: nothing comes back
    engine.start_session(0, "NATF2", "", SamplingParams(seed=1))  # a new caller starts with silence
    while not engine.core.is_live(0):
        engine.step(np.zeros((2, engine.frame_size), np.float32))
    assert not engine.step(frames[0]).pcm.any()


def test_importing_it_changes_no_other_runtime(tiny_cache_dir):
    import bench.loopback_app  # noqa: F401 -- imported above too; only running it as a script installs it
    from personaplex_demo.runtime import build

    assert build.build_runtime.__module__ == "personaplex_demo.runtime.build"
