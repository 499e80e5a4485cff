"""The CUDA-graph wrapper: same results as the eager function, eager where no GPU exists."""

from __future__ import annotations

import pytest
import torch

from personaplex_demo.engine.cuda_graphs import CudaGraphed


def test_disabled_without_a_gpu_and_calls_through():
    calls = []
    g = CudaGraphed(lambda x: calls.append(1) or x * 2, "test", enabled=True)
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert not g.enabled
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0)) and len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stateful_function_advances_once_per_call_when_graphed():
    state = torch.zeros(4, device="cuda")

    def tick(x):
        state.add_(x)
        return state * 1

    g = CudaGraphed(tick, "test")
    outs = [g(torch.full((4,), float(i), device="cuda")).clone() for i in range(1, 6)]
    assert [float(o[0]) for o in outs] == [1.0, 3.0, 6.0, 10.0, 15.0]
    assert g._graphs, "the third call onward should replay a captured graph"
