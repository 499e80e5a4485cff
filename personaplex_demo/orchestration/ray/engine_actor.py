"""One engine as a Ray actor: what an engine process runs (runtime + SlotPool + PoolServer), found by
name. Its methods are for control only; the frames go over the PoolServer's TCP link. It is threaded
(`max_concurrency`) so that `until_stopped`, which the page's process waits on, never holds up the others.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from ...logs import configure_logging
from ...runtime.build import RuntimeOptions
from ...serving.config import PoolConfig
from ..engine_process import END_CALLS_JOIN_SECONDS, ServedEngine

log = logging.getLogger(__name__)

ENGINE_RESOURCE = "personaplex_engine"  # a CPU node offers engines with `ray start --resources`
HEARTBEAT_SECONDS = 0.25  # pool figures this often: the page's watchdog hears silence within ~1 s
CONCURRENCY = 4  # until_stopped waits in one thread; endpoint, end_calls and stop need the others


@dataclass(frozen=True)
class RayEngineSpec:
    name: str
    authkey: bytes
    runtime: RuntimeOptions  # the device is the actor's own: its GPU, or the CPU
    pool: PoolConfig
    log_level: int = logging.INFO


class EngineActor:
    def __init__(self, spec: RayEngineSpec) -> None:
        configure_logging(spec.log_level, prefix=spec.name)
        self.name = spec.name
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is cuda:0 here.
        device = "cuda:0" if ray.get_gpu_ids() else "cpu"
        node = ray.util.get_node_ip_address()
        self.engine = ServedEngine(spec.runtime, spec.pool, device, (node, 0), spec.authkey, spec.name,
                                   facts={"node": node, "node_id": ray.get_runtime_context().get_node_id(),
                                          "pid": os.getpid()},
                                   figures_seconds=HEARTBEAT_SECONDS)
        # The page's machine may not have the model's files: it counts persona tokens with this copy
        # (in the Hello every link gets).
        self.engine.facts["tokenizer_model"] = Path(self.engine.facts["tokenizer_path"]).read_bytes()
        self._stopped = threading.Event()
        self.engine.start()
        log.info("%s ready on %s (%s), serving at %s:%d", spec.name, node, device, *self.engine.server.address)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return self.name

    def endpoint(self) -> dict[str, Any]:
        """Where to link to it, and where it runs."""
        host, port = self.engine.server.address
        return {"host": host, "port": port, "node": self.engine.facts["node"], "device": self.engine.facts["device"]}

    def until_stopped(self) -> bool:
        """Returns when `stop` runs; the caller learns of the actor's death from the error instead."""
        self._stopped.wait()
        return True

    def end_calls(self) -> None:
        """End every call with reason "shutdown"; the link stays up to tell the callers."""
        self.engine.end_calls()

    def stop(self) -> None:
        self.engine.stop(join_timeout=END_CALLS_JOIN_SECONDS)
        self._stopped.set()
