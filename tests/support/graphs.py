"""A CPU stand-in for `CudaBackend`: its graphs capture nothing and "replay" by calling the
function on the static inputs, as a CUDA graph re-runs its kernels on the captured buffers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from personaplex_demo.engine.cuda_graphs import CudaBackend


def _structure(output: Any) -> Any:
    """Fresh tensors shaped like `output`'s (tuples and named tuples kept)."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    items = [_structure(o) for o in output]
    return type(output)(*items) if hasattr(output, "_fields") else tuple(items)


def copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
        return
    for d, s in zip(dst, src, strict=True):
        copy_into(d, s)


@dataclass
class FakeGraph:
    backend: FakeBackend
    fn: Any = None
    inputs: tuple = ()
    output: Any = None  # a tensor, or a tuple of them
    pool: Any = None
    stream: Any = None
    replays: int = 0
    baked: Any = None  # `FakeBackend.snapshot()` at capture

    def replay(self) -> None:
        self.backend.events.append(("replay", self.backend.device()))
        # A real replay re-runs kernels only: Python-side values read by `fn` stay as captured.
        assert self.backend.snapshot() == self.baked, "a value the graph baked in has changed since capture"
        self.backend.replaying = True
        try:
            out = self.fn(*self.inputs)
        finally:
            self.backend.replaying = False
        copy_into(self.output, out)  # a graph writes into the output memory it captured
        self.replays += 1


@dataclass
class FakeBackend(CudaBackend):
    """CPU stand-in; assumes `fn` returns one tensor shaped like its first input, unless
    `run_at_capture` is set."""

    fail: bool = False  # captures raise, like an OOM, while set
    run_at_capture: bool = False  # see `capture`
    snapshot: Any = lambda: None  # Python-side values `fn` reads, which a real capture bakes in
    replaying: bool = False
    events: list = field(default_factory=list)  # (what, device context active then)
    active: list = field(default_factory=list)  # the device-context stack
    graphs: list = field(default_factory=list)
    pools: list = field(default_factory=list)
    synced: list = field(default_factory=list)

    def device(self) -> torch.device | None:
        return self.active[-1] if self.active else None

    def available(self) -> bool:
        return True

    def eligible(self, t: torch.Tensor) -> bool:
        return t.device.type in ("cpu", "meta")

    def graph(self) -> FakeGraph:
        self.graphs.append(FakeGraph(self))
        return self.graphs[-1]

    def pool(self, device: torch.device) -> object:
        self.pools.append((device, object()))  # a fresh object each time: sharing is the wrapper's
        return self.pools[-1][1]

    def stream(self, device: torch.device) -> object:
        return ("stream", device, object())

    @contextlib.contextmanager
    def device_context(self, device: torch.device) -> Iterator[None]:
        self.active.append(device)
        try:
            yield
        finally:
            self.active.pop()

    @contextlib.contextmanager
    def warmup_context(self, stream: Any) -> Iterator[None]:
        self.events.append(("warmup", self.device()))
        yield

    def capture(self, graph: FakeGraph, fn: Any, inputs: tuple, pool: Any, stream: Any) -> Any:
        self.events.append(("capture", self.device()))
        if self.fail:
            raise RuntimeError("CUDA out of memory (stand-in)")
        graph.fn, graph.inputs, graph.pool, graph.stream = fn, inputs, pool, stream
        graph.baked = self.snapshot()
        # Nothing runs at a real capture. `run_at_capture` learns the output's structure by
        # running `fn` once, for functions that leave their state as it was (no row live).
        graph.output = _structure(fn(*inputs)) if self.run_at_capture else torch.empty_like(inputs[0])
        return graph.output

    def synchronize(self, device: torch.device) -> None:
        self.synced.append(device)
