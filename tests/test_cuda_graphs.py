"""The CUDA-graph wrapper: same results as the eager function, eager where no GPU exists.

Most checks run on the CPU through `FakeBackend`, a stand-in for `CudaBackend` whose graphs
capture nothing and "replay" by calling the function on the static inputs, as a CUDA graph
re-runs its kernels on the captured buffers.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from personaplex_demo.engine.cuda_graphs import CudaGraphed

from .support.graphs import FakeBackend


def counter(backend: FakeBackend) -> tuple[Any, torch.Tensor, list[str]]:
    """A stateful tick that advances `state` in place; `calls` says how each call ran."""
    state = torch.zeros(4)
    calls: list[str] = []

    def tick(x: torch.Tensor) -> torch.Tensor:
        calls.append("replay" if backend.replaying else "eager")
        state.add_(x)
        return state * 1

    return tick, state, calls


def test_disabled_without_a_gpu_and_calls_through():
    calls = []
    g = CudaGraphed(lambda x: calls.append(1) or x * 2, "test", enabled=True)
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert not g.enabled and g.captured == 0 and g.failed == 0
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0)) and len(calls) == 1


def test_disabled_wrapper_never_touches_the_backend():
    backend = FakeBackend()
    tick, state, calls = counter(backend)
    g = CudaGraphed(tick, "test", False, backend=backend)
    for _ in range(3):
        g(torch.ones(4), key="k")
    g.capture(torch.ones(4), key="k")
    assert not g.enabled and (g.captured, g.failed, g.keys()) == (0, 0, [])
    assert calls == ["eager"] * 4 and torch.equal(state, torch.full((4,), 4.0))
    assert backend.events == [] and backend.graphs == []


def test_stateful_function_advances_once_per_call_and_matches_eager():
    backend = FakeBackend()
    tick, state, calls = counter(backend)
    g = CudaGraphed(tick, "test", backend=backend)
    ref_state = torch.zeros(4)
    outs, refs = [], []
    for i in range(1, 7):
        x = torch.arange(4.0) * i
        outs.append(g(x, key="k"))
        refs.append(ref_state.add_(x) * 1)
    # warm-up, capture + replay, then replays: one execution of the function per call
    assert calls == ["eager"] + ["replay"] * 5
    assert [e[0] for e in backend.events] == ["warmup", "capture"] + ["replay"] * 5
    assert torch.equal(state, ref_state)
    # equal to eager, and cloned: later replays do not overwrite earlier outputs
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))
    assert (g.captured, g.failed, g.keys()) == (1, 0, ["k"])


def test_failed_capture_falls_back_for_that_key_only(caplog):
    backend = FakeBackend()
    tick, state, calls = counter(backend)
    g = CudaGraphed(tick, "test", backend=backend)
    x = torch.ones(4)
    g(x, key="good"), g(x, key="good")
    good = backend.graphs[0]
    g(x, key="bad")  # warm-up
    backend.fail = True
    with caplog.at_level(logging.WARNING, logger="personaplex_demo.engine.cuda_graphs"):
        g(x, key="bad")  # capture raises: this call runs eagerly
        backend.fail = False
        g(x, key="bad"), g(x, key="bad")  # remembered: eager, never captured again
    g(x, key="good")
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert [e[0] for e in backend.events].count("capture") == 2  # good's, and bad's one try
    assert backend.synced == [x.device]  # the device was checked before the eager call
    assert g.enabled and (g.captured, g.failed, g.keys()) == (1, 1, ["good"])
    # the surviving graph is the same object, never reset, and still replays
    assert g._graphs[next(iter(g._graphs))].graph is good and good.replays == 2
    assert calls == ["eager", "replay", "eager", "eager", "eager", "eager", "replay"]
    assert torch.equal(state, torch.full((4,), 7.0))  # seven calls, seven advances


def test_capture_at_start_up_makes_the_first_call_a_replay():
    backend = FakeBackend()
    tick, state, calls = counter(backend)
    g = CudaGraphed(tick, "test", backend=backend)
    out = g.capture(torch.ones(4), key="k")  # never seen: warm-up, then capture (runs nothing)
    assert calls == ["eager"] and torch.equal(out, torch.ones(4)) and g.captured == 1
    assert torch.equal(g(torch.full((4,), 2.0), key="k"), torch.full((4,), 3.0))
    assert calls == ["eager", "replay"]
    assert torch.equal(g.capture(torch.ones(4), key="k"), torch.full((4,), 4.0))  # held: replays once
    g(torch.ones(4), key="w")  # warmed up, not captured: capture replays once
    assert torch.equal(g.capture(torch.ones(4), key="w"), torch.full((4,), 6.0))
    assert calls == ["eager", "replay", "replay", "eager", "replay"]
    assert torch.equal(state, torch.full((4,), 6.0)) and g.keys() == ["k", "w"]


def test_all_keys_of_a_wrapper_share_one_pool_and_stream():
    backend = FakeBackend()
    g = CudaGraphed(lambda x: x * 2, "test", backend=backend)
    other = CudaGraphed(lambda x: x * 3, "other", backend=backend)
    for key in ("a", "b", "c"):
        g.capture(torch.ones(4), key=key)
    g.capture(torch.ones(2), key="a")  # same key, new shape: one more graph in the same pool
    other.capture(torch.ones(4), key="a")
    mine, theirs = backend.graphs[:4], backend.graphs[4]
    assert g.captured == 4 and g.keys() == ["a", "b", "c", "a"]
    assert all(gr.pool is mine[0].pool and gr.stream is mine[0].stream for gr in mine)
    assert theirs.pool is not mine[0].pool and len(backend.pools) == 2


def test_capture_and_replay_run_under_the_inputs_device():
    backend = FakeBackend()
    g = CudaGraphed(lambda x: x * 2, "test", backend=backend)
    for device in ("cpu", "meta", "cpu", "meta", "meta"):
        g(torch.ones(4, device=device), key="k")
    whats = [(what, str(dev)) for what, dev in backend.events]
    assert whats == [("warmup", "cpu"), ("warmup", "meta"), ("capture", "cpu"), ("replay", "cpu"),
                     ("capture", "meta"), ("replay", "meta"), ("replay", "meta")]
    assert backend.active == []  # every context was left
    # one pool (and stream) per device
    assert [str(d) for d, _ in backend.pools] == ["cpu", "meta"]
    assert backend.graphs[0].stream is not backend.graphs[1].stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stateful_function_advances_once_per_call_when_graphed():
    state = torch.zeros(4, device="cuda")

    def tick(x):
        state.add_(x)
        return state * 1

    g = CudaGraphed(tick, "test")
    outs = [g(torch.full((4,), float(i), device="cuda")).clone() for i in range(1, 6)]
    assert [float(o[0]) for o in outs] == [1.0, 3.0, 6.0, 10.0, 15.0]
    assert g.captured == 1 and g.failed == 0, "the third call onward should replay a captured graph"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_keys_share_a_pool_and_start_up_capture_replays_on_cuda():
    state = torch.zeros(8, device="cuda")

    def tick(x):
        state.add_(x.sum())
        return state * 1

    g = CudaGraphed(tick, "test")
    for n in (1, 2, 4):
        g.capture(torch.ones(n, device="cuda"), key=n)
    assert g.captured == 3 and float(state[0]) == 7.0
    for n in (1, 2, 4):
        assert float(g(torch.ones(n, device="cuda"), key=n)[0]) == float(state[0])
    assert float(state[0]) == 14.0 and g.failed == 0
