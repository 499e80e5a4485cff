"""`--context SECONDS`: a shorter temporal ring that wraps, token for token with the reference."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gpu_checks import first_divergence
from personaplex_demo.engine.core import LockstepCore
from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.runtime.capacity import context_frames
from tests.support.stepwise import StepwiseCore

from .conftest import golden
from .lm_fixtures import tiny_lm


@pytest.mark.parametrize("stepwise", [False, True])
def test_a_short_context_equals_the_reference_with_that_context(stepwise):
    """The golden lm-wrap session ran the reference with its context cut to 20 frames; the
    served model keeps its 3000-frame window and gets 20 frames from --context 1.6 alone."""
    g = golden("lm-wrap.json")
    assert g["model"]["config_overrides"] == {"context": 20}
    lm = tiny_lm()
    assert lm.cfg.context == 3000
    core = (StepwiseCore if stepwise else LockstepCore)(lm, 1, context=context_frames(1.6, lm.cfg.context))
    diff, compared = first_divergence(core, g, stepwise)
    assert diff is None, f"first difference at o={diff}"
    assert compared >= 80 and int(core.state.kv.end[0]) > 5 * 20  # wrapped five times and more


def test_a_call_runs_on_past_a_short_context(tiny_cache_dir):
    engine = build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir,
                                          context=context_frames(2, 3000))).engine
    assert engine.core.state.kv.capacity == 25
    engine.start_session(0, "NATF2", "You enjoy having a good conversation.", SamplingParams(seed=3))
    rng = np.random.default_rng(3)
    texts = []
    for _ in range(100):  # 8 s of conversation through a 2 s window
        out = engine.step(np.stack([0.1 * rng.standard_normal(1920).astype(np.float32), np.zeros(1920, np.float32)]))
        assert bool(out.live[0]) and not bool(out.live[1])
        assert np.isfinite(out.pcm).all() and np.abs(out.pcm[0]).max() > 0
        texts.append(out.tokens[0].copy())
    assert int(engine.core.state.kv.end[0]) > 4 * 25
    # Still choosing tokens after the wraps, not stuck on one frame.
    assert len({t.tobytes() for t in texts[-25:]}) > 5
