"""Engine processes: one engine and its SlotPool per device, each in a process of its own, served by
a `PoolServer` and reached through a `PoolRouter` (docs/processes.md § How they start). The main
process loads no model: the page needs only each engine's facts and the tokenizer (`RemoteRuntime`).
"""

from __future__ import annotations

import logging
import socket
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..procs.channel import Address, Channel
from ..procs.launcher import Child, Inbox, stop_children
from ..procs.messages import EndCalls, EngineFailed, EngineReady
from ..procs.pool_server import FIGURES_SECONDS, PoolServer
from ..runtime.build import Runtime, RuntimeOptions, build_runtime
from ..runtime.facts import EngineFacts
from ..serving.config import PoolConfig
from ..serving.pool import SlotPool

log = logging.getLogger(__name__)

STOP_SECONDS = 10.0  # an engine's time to end its calls and exit after Stop, before it is killed
END_CALLS_JOIN_SECONDS = 3.0  # an engine's wait for its ticker on EndCalls (the process stays up)
FAILED_FLUSH_SECONDS = 5.0  # for the EngineFailed message to leave before the process exits


@dataclass(frozen=True)
class EngineSpec:
    """An engine process's, or a Ray actor's (whose device and address are its own)."""

    name: str
    authkey: bytes
    runtime: RuntimeOptions
    pool: PoolConfig
    device: str = "cpu"
    address: str = ""
    torch_threads: int | None = None  # several CPU engines share the cores
    log_level: int = logging.INFO


def page_facts(runtime: Runtime) -> dict[str, Any]:
    """What the page and the media workers need to know about an engine (plain data)."""
    engine = runtime.engine
    return {"model_name": runtime.model_name, "is_tiny": runtime.is_tiny, "banner": runtime.banner,
            "voice_names": list(engine.voice_names), "max_persona_tokens": engine.max_persona_tokens,
            "tokenizer_path": str(runtime.source.tokenizer_path), "device": str(runtime.device),
            "weights": runtime.weights, "capacity": runtime.capacity_facts(), "node": socket.gethostname()}


class ServedEngine:
    """One engine as every engine host runs it (an engine process, a Ray actor): the runtime on
    its device, its SlotPool, and the PoolServer that the engine links reach."""

    def __init__(self, options: RuntimeOptions, pool: PoolConfig, device: str, address: Address, authkey: bytes,
                 name: str, facts: dict[str, Any] | None = None, figures_seconds: float = FIGURES_SECONDS) -> None:
        self.runtime = build_runtime(replace(options, device=device))
        self.pool = SlotPool(self.runtime.engine, self.runtime.pool_config(pool))
        self.server = PoolServer(self.pool, address, authkey, name=name, figures_seconds=figures_seconds,
                                 facts={**page_facts(self.runtime), **(facts or {})})
        self.facts = self.server.facts  # what every link's Hello says

    def start(self) -> ServedEngine:
        self.pool.start()
        self.server.start()
        return self

    def end_calls(self) -> None:
        """Every call ends (reason "shutdown") and the ticker stops; the server stays up to tell the callers."""
        self.pool.shutdown(join_timeout=END_CALLS_JOIN_SECONDS)

    def stop(self, join_timeout: float = 10.0) -> None:
        self.pool.shutdown(join_timeout=join_timeout)
        self.server.close()


def run_engine(spec: EngineSpec, conn) -> None:
    """An engine process's entry point (after `launcher`'s preamble): load, serve, and stop when
    told (or when the main process goes away)."""
    import torch

    inbox = Inbox()
    control = Channel(conn, f"{spec.name} control", inbox.on_batch, inbox.on_close).start()
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        engine = ServedEngine(spec.runtime, spec.pool, spec.device, spec.address, spec.authkey, spec.name)
    except Exception as exc:
        control.send(EngineFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        control.close(flush_timeout=FAILED_FLUSH_SECONDS)  # the writer is a daemon thread: let it say so first
        return
    engine.start()
    control.send(EngineReady(engine.facts))
    try:
        # EndCalls: the pool ends its calls, and the server stays up to tell the callers;
        # Stop, or None (EOF: the main process is gone): everything stops.
        while isinstance(inbox.get(), EndCalls):
            engine.end_calls()
    finally:
        engine.stop()
        control.close()


class EngineProcesses:
    """The main process's handle on its engine processes."""

    def __init__(self, specs: list[EngineSpec]) -> None:
        self.specs = specs
        self._children: list[tuple[Child, Inbox]] = []

    def start(self) -> EngineProcesses:
        for spec in self.specs:
            inbox = Inbox()
            child = Child(spec.name, run_engine, spec, spec.log_level).start(inbox.on_batch, inbox.on_close)
            self._children.append((child, inbox))
        return self

    def wait_ready(self) -> list[dict[str, Any]]:
        """Each engine's page facts, once all have loaded; raises if one failed."""
        facts = []
        for spec, (child, inbox) in zip(self.specs, self._children, strict=True):
            match inbox.get():
                case EngineReady(facts=ready):
                    facts.append(ready)
                case EngineFailed(error=error, traceback=trace):
                    log.error("%s failed to load:\n%s", spec.name, trace)
                    raise RuntimeError(f"{spec.name} ({spec.device}) failed to load: {error}")
                case _:  # None: the channel closed without a word
                    child.process.join(1.0)
                    raise RuntimeError(f"{spec.name} ({spec.device}) exited while loading (exit code "
                                       f"{child.process.exitcode})")
        return facts

    def end_calls(self, join_timeout: float = 3.0) -> None:
        """Each engine ends its calls with reason "shutdown" and stops ticking (waiting END_CALLS_JOIN_SECONDS)."""
        for child, _ in self._children:
            child.send(EndCalls())

    def close(self) -> None:
        stop_children([child for child, _ in self._children], STOP_SECONDS)


@dataclass
class RemoteRuntime:
    """The page's `RuntimeFacts` when the engines run in other processes, built from their facts."""

    engine: EngineFacts
    model_name: str
    is_tiny: bool
    banner: str | None
    weights: str = "dense"
    device_name: str = "cpu"
    capacity: dict[str, Any] | None = None

    def capacity_facts(self) -> dict[str, Any] | None:
        return self.capacity

    @classmethod
    def from_facts(cls, facts: dict[str, Any], others: Sequence[dict[str, Any]] = ()) -> RemoteRuntime:
        """From the first engine's facts; `others`: the other engines'. The room's slots were set by
        the devices' memory (`capacity["bound"]`, for /api/status's limited_by) only if every
        engine's were."""
        capacity = facts.get("capacity")
        if capacity is not None and any((f.get("capacity") or {}).get("bound") != capacity.get("bound")
                                        for f in others):
            capacity = {**capacity, "bound": "slots"}
        return cls(EngineFacts(facts), facts["model_name"], bool(facts["is_tiny"]), facts["banner"],
                   facts.get("weights", "dense"), str(facts.get("device", "cpu")), capacity)
