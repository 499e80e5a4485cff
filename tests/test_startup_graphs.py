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


def graphed_core(lm, batch: int) -> tuple[LockstepCore, list[FakeBackend]]:
    """A core whose two graph wrappers replay on stand-ins that check that the Python-side value
    each part reads (and a real capture would bake in) is the one it was captured with."""
    core = LockstepCore(lm, batch, context=CONTEXT)
    listen = FakeBackend(run_at_capture=True, snapshot=lambda: core._visible)
    speak = FakeBackend(run_at_capture=True, snapshot=lambda: core._top_k)
    core._graphed_listen = CudaGraphed(core._live_listen, "lockstep temporal", backend=listen)
    core._graphed_speak = CudaGraphed(core._speak, "lockstep depformer", backend=speak)
    return core, [listen, speak]


def test_the_key_set_is_bounded_and_known_before_the_first_caller():
    core = LockstepCore(tiny_lm(), 2, context=CONTEXT)
    batches, visible, top_k = core.graph_keys()
    assert batches == [1, 2]
    assert visible == [256, 512, 768, None]
    assert top_k == [(t, a) for t in (32, 256, 2048, 32000) for a in (32, 256, 2048)]
    core.attend_filled = False
    assert core.graph_keys()[1] == [None]
    assert LockstepCore(tiny_lm(), 12, context=CONTEXT).graph_keys()[0] == [1, 2, 4, 8, 12]


def test_every_key_is_captured_at_start_up_and_serving_only_replays():
    lm = tiny_lm()
    eager = LockstepCore(lm, 2, context=CONTEXT)
    core, backends = graphed_core(lm, 2)
    held = core.capture_graphs()
    batches, visible, top_k = core.graph_keys()
    assert held == len(batches) * (len(visible) + len(top_k)) == 32
    def events(what: str) -> int:
        return sum(e[0] == what for b in backends for e in b.events)

    captures = events("capture")
    # Callers with different top-k settings, long enough to cross a visible-slot bucket.
    settings = [SamplingParams(seed=1), SamplingParams(seed=2, text_top_k=300, audio_top_k=2000),
                SamplingParams(seed=3, text_top_k=5, audio_top_k=20)]
    voice, persona = golden_voice("voice-A"), golden_persona("persona-A")
    g = torch.Generator().manual_seed(0)
    seen, batches_run = set(), set()
    for tick in range(3 * VISIBLE_BUCKET // 2):
        if tick % 120 == 0:
            params = settings[(tick // 120) % len(settings)]
            for c in (eager, core):
                c.start(tick // 120 % 2, voice, persona, params, seed=tick)
        # One caller steps a batch of one row; two, of both (engine/rows.py).
        user = torch.randint(0, 2048, (1 if tick < 120 else 2, 8), generator=g)
        a, b = eager.step(user), core.step(user)
        seen.add(core._visible)
        batches_run.add(len(user))
        assert torch.equal(a.frame, b.frame) and torch.equal(a.emitted, b.emitted), f"tick {tick}"
    assert events("capture") == captures, "serving captured a graph"
    assert all(w.captured and not w.failed for w in core.graphed)
    assert events("replay") == 2 * 3 * VISIBLE_BUCKET // 2
    assert {VISIBLE_BUCKET, 2 * VISIBLE_BUCKET} <= seen, "the calls crossed a visible-slot bucket"
    assert batches_run == {1, 2}
