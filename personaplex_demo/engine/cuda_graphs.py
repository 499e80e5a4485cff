"""CUDA graphs for the per-tick hot path, with a per-key eager fallback (docs/engine.md § CUDA graphs).

The wrapped function takes tensors only, keeps every state tensor in place (a graph replays into the
addresses it captured), changes no Python-side state (that runs once, at capture) and makes no host
sync. The first call for a key runs eagerly (warm-up), the second captures (no kernel runs) and
replays, so every call advances the state exactly once. The caller bounds its set of keys.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


class CudaBackend:
    """Every `torch.cuda` call of the wrapper, so that tests can stand in a CPU fake."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def eligible(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def device_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        # torch.cuda.graph synchronizes and captures on the *current* device (pytorch issue 87894).
        return torch.cuda.device(device)

    @contextlib.contextmanager
    def warmup_context(self, stream: Any) -> Iterator[None]:
        # Warm up on the capture stream: cuBLAS(Lt) handles and workspaces are cached per
        # (device, stream), and creating one mid-capture is capture-unsafe (pytorch PR 187745).
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)

    def capture(self, graph: Any, fn: Callable[..., object], inputs: tuple[torch.Tensor, ...],
                pool: Any, stream: Any) -> object:
        """Record `fn(*inputs)` into `graph` (no kernel runs); return its static output."""
        # The outer stream context restores the caller's stream even when capture_end raises,
        # which makes torch.cuda.graph.__exit__ skip its own restore. "thread_local": other
        # threads' allocations and queries do not invalidate this capture.
        with torch.cuda.stream(torch.cuda.current_stream(stream.device)), torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            return fn(*inputs)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


@dataclass
class _Captured:
    key: Hashable  # the caller's key
    graph: Any
    inputs: tuple[torch.Tensor, ...]  # the static inputs the graph reads
    output: object  # the static output the graph writes; cloned after every replay


class CudaGraphed:
    """`fn` behind CUDA graphs, one per key; called as `wrapper(*tensors, key=hashable)`."""

    def __init__(self, fn: Callable[..., object], name: str, enabled: bool = True,
                 backend: CudaBackend | None = None) -> None:
        self.fn = fn
        self.name = name
        self._backend = backend if backend is not None else CudaBackend()
        self.enabled = enabled and self._backend.available()
        self._seen: set[Hashable] = set()  # keys warmed up by one eager call
        self._graphs: dict[Hashable, _Captured] = {}
        self._failed: set[Hashable] = set()  # keys whose capture failed: eager for good
        self._devices: dict[torch.device, tuple[Any, Any]] = {}  # per device: (pool all keys share, stream)

    @property
    def captured(self) -> int:
        """Graphs held (0 on a GPU means every call ran eagerly)."""
        return len(self._graphs)

    @property
    def failed(self) -> int:
        """Keys whose capture failed and which run eagerly."""
        return len(self._failed)

    def keys(self) -> list[Hashable]:
        """The caller's key of every graph held, in capture order (once per input signature)."""
        return [cap.key for cap in self._graphs.values()]

    def __call__(self, *inputs: torch.Tensor, key: Hashable = ()) -> object:
        """`fn(*inputs)`: eager, or by replaying this key's graph. Advances the state once."""
        full = self._graph_key(inputs, key)
        if full is None:
            return self.fn(*inputs)
        cap = self._graphs.get(full)
        if cap is None and full not in self._seen:
            return self._warm_up(full, inputs)
        if cap is None:
            cap = self._capture(full, key, inputs)
        return self.fn(*inputs) if cap is None else self._replay(cap, inputs)

    def capture(self, *inputs: torch.Tensor, key: Hashable = ()) -> object:
        """Capture the graph of `key` now, so that the first `__call__` for it replays. Changes the
        state as one call does and returns its output: an engine captures before any row is live."""
        full = self._graph_key(inputs, key)
        if full is None or full in self._graphs or full in self._seen:
            return self(*inputs, key=key)
        output = self._warm_up(full, inputs)
        self._capture(full, key, inputs)  # on failure the key is eager from now on
        return output

    def _graph_key(self, inputs: tuple[torch.Tensor, ...], key: Hashable) -> Hashable | None:
        """The graph's key, or None where this call must run eagerly."""
        if not self.enabled or not inputs or not all(self._backend.eligible(t) for t in inputs) or any(
                t.device != inputs[0].device for t in inputs):
            return None
        full = (key, tuple((t.shape, t.dtype, t.device) for t in inputs))
        return None if full in self._failed else full

    def _warm_up(self, full: Hashable, inputs: tuple[torch.Tensor, ...]) -> object:
        device = inputs[0].device
        with self._backend.device_context(device), self._backend.warmup_context(self._pool_stream(device)[1]):
            output = self.fn(*inputs)
        self._seen.add(full)
        return output

    def _capture(self, full: Hashable, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> _Captured | None:
        device = inputs[0].device
        static = tuple(t.clone() for t in inputs)  # outside the pool: the caller's allocator
        pool, stream = self._pool_stream(device)
        try:
            with self._backend.device_context(device):
                graph = self._backend.graph()
                output = self._backend.capture(graph, self.fn, static, pool, stream)
        except Exception as e:  # this key runs eagerly; other keys' graphs stay as they are
            self._failed.add(full)
            log.warning("%s: CUDA graph capture failed for key %s (%s: %s); that key runs eagerly",
                        self.name, key, type(e).__name__, e)
            try:  # make sure the failed capture left the device usable before the eager call
                with self._backend.device_context(device):
                    self._backend.synchronize(device)
            except Exception as sync_error:
                log.error("%s: device unusable after a failed capture: %s", self.name, sync_error)
            return None
        cap = self._graphs[full] = _Captured(key, graph, static, output)
        log.info("%s: captured a CUDA graph for key %s (%d held)", self.name, key, len(self._graphs))
        return cap

    def _replay(self, cap: _Captured, inputs: tuple[torch.Tensor, ...]) -> object:
        with self._backend.device_context(inputs[0].device):
            for dst, src in zip(cap.inputs, inputs, strict=True):
                dst.copy_(src)
            cap.graph.replay()
            # Clone: the next replay overwrites the static output; the caller's result outlives it.
            return _clone(cap.output)

    def _pool_stream(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._devices:
            self._devices[device] = (self._backend.pool(device), self._backend.stream(device))
        return self._devices[device]


def _clone(output: object) -> object:
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        items = [_clone(o) for o in output]
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)
    return output
