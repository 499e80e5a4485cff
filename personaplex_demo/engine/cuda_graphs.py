"""CUDA graphs for the per-tick hot path, with an eager fallback.

A tick is hundreds of small kernels at small batch sizes, so on a GPU the launch overhead
dominates; replaying a captured graph removes it. The wrapped function must keep every state
tensor in place (same storage), take tensors only, and be free of host syncs.

The first call for a key runs eagerly (it warms up the allocator and any lazy init); the second
captures the graph and replays it; later calls copy their inputs into the captured buffers and
replay. Capturing does not execute kernels, so stateful functions advance exactly once per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: object


@dataclass
class CudaGraphed:
    fn: Callable[..., object]
    name: str
    enabled: bool = True
    _seen: set = field(default_factory=set)
    _graphs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.enabled and not torch.cuda.is_available():
            self.enabled = False

    def __call__(self, *inputs: torch.Tensor, key: Hashable = ()) -> object:
        if not self.enabled or not all(t.is_cuda for t in inputs):
            return self.fn(*inputs)
        full_key = (key, tuple((t.shape, t.dtype) for t in inputs))
        cap = self._graphs.get(full_key)
        if cap is not None:
            for dst, src in zip(cap.inputs, inputs):
                dst.copy_(src)
            cap.graph.replay()
            return _clone(cap.output)
        if full_key not in self._seen:
            self._seen.add(full_key)
            return self.fn(*inputs)
        try:
            static = tuple(t.clone() for t in inputs)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                output = self.fn(*static)
            self._graphs[full_key] = _Captured(graph, static, output)
            graph.replay()
            log.info("%s: captured a CUDA graph for %s", self.name, full_key)
            return _clone(output)
        except Exception as e:  # capture failed: keep serving, eagerly
            log.warning("%s: CUDA graph capture failed (%s: %s); running eagerly", self.name, type(e).__name__, e)
            self.enabled = False
            self._graphs.clear()
            return self.fn(*inputs)


def _clone(output: object) -> object:
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return type(output)(*(_clone(o) for o in output)) if hasattr(output, "_fields") else tuple(
            _clone(o) for o in output)
    return output
