"""CUDA graphs captured at start-up, for every key a tick can meet: serving then only replays.

On the CPU, the stand-in backend of tests/support/graphs.py plays the GPU: its "replay" re-runs
the tick on the captured inputs, so the tokens of a graphed core can be compared with an eager one.
"""

from __future__ import annotations

import torch

from personaplex_demo.engine.core import VISIBLE_BUCKET, LockstepCore
from personaplex_demo.engine.cuda_graphs import CudaGraphed
from personaplex_demo.engine.pcm import SamplingParams

from .lm_fixtures import golden_persona, golden_voice, tiny_lm
from .support.graphs import FakeBackend

CONTEXT = 3 * VISIBLE_BUCKET + 40


def graphed_core(lm, batch: int) -> tuple[LockstepCore, FakeBackend]:
    core = LockstepCore(lm, batch, context=CONTEXT)
    backend = FakeBackend(run_at_capture=True)
    core._graphed_listen = CudaGraphed(core._live_listen, "lockstep temporal", backend=backend)
    core._graphed_speak = CudaGraphed(core._speak, "lockstep depformer", backend=backend)
    return core, backend


def test_the_key_set_is_bounded_and_known_before_the_first_caller():
    core = LockstepCore(tiny_lm(), 2, context=CONTEXT)
    visible, top_k = core.graph_keys()
    assert visible == [256, 512, 768, None]
    assert top_k == [(t, a) for t in (32, 256, 2048, 32000) for a in (32, 256, 2048)]
    core.attend_filled = False
    assert core.graph_keys()[0] == [None]


def test_every_key_is_captured_at_start_up_and_serving_only_replays():
    lm = tiny_lm()
    eager = LockstepCore(lm, 2, context=CONTEXT)
    core, backend = graphed_core(lm, 2)
    held = core.capture_graphs()
    visible, top_k = core.graph_keys()
    assert held == len(visible) + len(top_k) == 16
    captures = len([e for e in backend.events if e[0] == "capture"])
    # Callers with different top-k settings, long enough to cross a visible-slot bucket.
    settings = [SamplingParams(seed=1), SamplingParams(seed=2, text_top_k=300, audio_top_k=2000),
                SamplingParams(seed=3, text_top_k=5, audio_top_k=20)]
    voice, persona = golden_voice("voice-A"), golden_persona("persona-A")
    g = torch.Generator().manual_seed(0)
    for tick in range(3 * VISIBLE_BUCKET // 2):
        if tick % 120 == 0:
            params = settings[(tick // 120) % len(settings)]
            for c in (eager, core):
                c.start(tick // 120 % 2, voice, persona, params, seed=tick)
        user = torch.randint(0, 2048, (2, 8), generator=g)
        a, b = eager.step(user), core.step(user)
        assert torch.equal(a.frame, b.frame) and torch.equal(a.emitted, b.emitted), f"tick {tick}"
    assert len([e for e in backend.events if e[0] == "capture"]) == captures, "serving captured a graph"
    assert all(w.captured and not w.failed for w in core.graphed)
    assert len([e for e in backend.events if e[0] == "replay"]) == 2 * 3 * VISIBLE_BUCKET // 2
