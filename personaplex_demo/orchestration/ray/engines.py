"""`--engines ray`: the engine actors (`EngineActor`), and the page's side: start them, link to each, and
keep the room's engines true while actors die and come back. A monitor thread keeps an `until_stopped` call
pending on every actor: Ray fails it within milliseconds of the actor's death. A restarted actor answers
`endpoint` once it has loaded."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError

from ...logs import configure_logging
from ...procs.channel import Address
from ...procs.engine_link import EngineLink, SilenceWatchdog
from ...procs.pool_router import PoolRouter
from ..engine_process import END_CALLS_JOIN_SECONDS, EngineSpec, ServedEngine

log = logging.getLogger(__name__)

ENGINE_RESOURCE = "personaplex_engine"  # a CPU node offers engines with `ray start --resources`
HEARTBEAT_SECONDS = 0.25  # pool figures this often: the page's watchdog hears silence within ~1 s
CONCURRENCY = 4  # until_stopped waits in one thread; endpoint, end_calls and stop need the others
READY_SECONDS = 900.0  # the real model downloads and loads on each GPU machine: minutes
MAX_RESTARTS = 3  # Ray brings a dead engine back this many times (its node permitting)
RETRY_SECONDS = 1.0  # between two tries to reach an engine that has not come back yet
STOP_SECONDS = 10.0


def connect(address: str | None, log_level: int) -> bool:
    """Join the Ray cluster at `address` ("auto": the one `ray start` runs on this machine), or
    start one here. True when this process started it (and so stops it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a demo's cluster
    kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": True, "logging_level": log_level,
                              "log_to_driver": True}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining the Ray cluster at %s", address)
        # The engines' machines need the pinned requirements, not this project: Ray ships its code to them.
        package = Path(__file__).resolve().parents[2]
        ray.init(address=address, runtime_env={"py_modules": [str(package)], "excludes": ["__pycache__"]}, **kwargs)
        return False
    log.info("starting Ray on this machine (no --ray-address)")
    # "local": a new one even if another app started a Ray here; a GPU, when there is one, wins (`plan`).
    ray.init(address="local", resources={ENGINE_RESOURCE: 1}, **kwargs)
    return True


def plan(resources: dict[str, float]) -> tuple[int, dict[str, Any]]:
    """How many engines the cluster holds, and the Ray options that place one."""
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return gpus, {"num_gpus": 1, "num_cpus": 0}
    units = int(resources.get(ENGINE_RESOURCE, 0))
    if units:
        return units, {"num_cpus": 0, "resources": {ENGINE_RESOURCE: 1}}
    raise RuntimeError(f"the Ray cluster has no GPU and no node offers {ENGINE_RESOURCE}: start GPU machines "
                       f"with `ray start --address=...`, or CPU ones with --resources '{{\"{ENGINE_RESOURCE}\": 1}}'")


class EngineActor:
    """One engine as a Ray actor, found by name: what an engine process runs (runtime, SlotPool,
    PoolServer). Its methods are for control only; the frames go over the PoolServer's TCP link. It is
    threaded (`max_concurrency`) so that `until_stopped`, which the page's process waits on, never holds
    up the others."""

    def __init__(self, spec: EngineSpec) -> None:
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


@dataclass
class _Engine:
    """One actor and the link to its current incarnation."""

    name: str
    actor: Any  # a ray ActorHandle
    link: EngineLink | None = None
    watching: Any = None  # the pending `until_stopped` ObjectRef
    asking: Any = None  # a pending `endpoint` ObjectRef, while it has not come back
    asked_at: float = 0.0
    gone: bool = False  # dead for good (no restarts left)
    node: str = "?"


class RayEngines:
    """The engine actors this app started, their links, and the thread that watches them."""

    def __init__(self, spec: EngineSpec, started_ray: bool) -> None:
        self.spec = spec
        self.started_ray = started_ray
        self.namespace = ray.get_runtime_context().namespace
        self.watchdog = SilenceWatchdog()
        self.router: PoolRouter | None = None
        self.on_relink: Callable[[int, Address], None] | None = None  # the media workers follow a comeback
        self._engines: list[_Engine] = []
        self._files = Path(tempfile.mkdtemp(prefix="personaplex-ray-"))
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="ray-engines", daemon=True)

    def start(self) -> RayEngines:
        count, options = plan(ray.available_resources())  # GPUs another job holds are not ours
        actor_class = ray.remote(EngineActor)
        for i in range(count):
            name = f"engine-{i}"
            actor = actor_class.options(name=name, max_restarts=MAX_RESTARTS, max_concurrency=CONCURRENCY,
                                        **options).remote(replace(self.spec, name=name))
            self._engines.append(_Engine(name, actor))
        log.info("placing %d engine actor(s) on the Ray cluster (%s)", count, options)
        return self

    def wait_ready(self, timeout: float = READY_SECONDS) -> PoolRouter:
        """Link to every engine once it has loaded; the room over all of them."""
        refs = [e.actor.endpoint.remote() for e in self._engines]
        try:
            endpoints = ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise RuntimeError(f"the Ray engines did not load within {timeout:.0f} s") from None
        except RayActorError as exc:
            raise RuntimeError(f"a Ray engine failed to start: {exc}") from None
        for engine, endpoint in zip(self._engines, endpoints, strict=True):
            self._link(engine, endpoint)
        self.router = PoolRouter([e.link for e in self._engines])
        self._monitor.start()
        return self.router

    def facts(self) -> list[dict[str, Any]]:
        """Every engine's page facts; the first one's with the tokenizer as a file on this machine."""
        first = dict(self._engines[0].link.facts)
        path = self._files / "tokenizer.model"
        path.write_bytes(first.pop("tokenizer_model"))
        return [{**first, "tokenizer_path": str(path)}, *(engine.link.facts for engine in self._engines[1:])]

    def status(self) -> list[dict[str, Any]]:
        """Per engine, for /api/status: the router's figures plus the actor's name and namespace."""
        if self.router is None:
            return []
        return [{**row, "actor": e.name, "namespace": self.namespace, "node_id": e.link.facts.get("node_id"),
                 "pid": e.link.facts.get("pid"), "gone": e.gone}
                for row, e in zip(self.router.engine_status(), self._engines, strict=True)]

    def end_calls(self, join_timeout: float = 3.0) -> None:
        refs = [e.actor.end_calls.remote() for e in self._engines if e.link is not None and e.link.alive]
        ray.wait(refs, num_returns=len(refs), timeout=join_timeout + 2.0)

    def close(self) -> None:
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(5.0)  # it may be linking: let it finish before the links close
        self.watchdog.close()
        if self.router is not None:
            self.router.close()
        # Only the linked ones: an actor lost with its node may wait for a place to restart, for ever.
        refs = [e.actor.stop.remote() for e in self._engines if e.link is not None and e.link.alive]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_SECONDS)
        for engine in self._engines:
            ray.kill(engine.actor, no_restart=True)
        if self.started_ray:
            ray.shutdown()
        shutil.rmtree(self._files, ignore_errors=True)

    # ---- links ---------------------------------------------------------------------------------

    def _link(self, engine: _Engine, endpoint: dict[str, Any]) -> None:
        link = EngineLink((endpoint["host"], endpoint["port"]), self.spec.authkey, name=engine.name)
        if self._stop.is_set():
            link.close()
            return
        engine.node, engine.gone = endpoint["node"], False
        if engine.watching is None:  # after a death; an actor that only went silent keeps its watch
            engine.watching = engine.actor.until_stopped.remote()
        if engine.link is not None and self.router is not None:
            self.router.replace(engine.link, link)
            log.info("%s is back on %s (%s): taking new calls", engine.name, engine.node, endpoint["device"])
            if self.on_relink is not None:
                self.on_relink(self._engines.index(engine), link.address)
        engine.link = link
        self.watchdog.watch(link)

    def _watch(self) -> None:
        """The monitor thread: an actor's death ends its calls at once; a comeback is linked to."""
        while not self._stop.is_set():
            pending = {e.watching: e for e in self._engines if e.watching is not None}
            pending.update({e.asking: e for e in self._engines if e.asking is not None})
            if not pending:
                self._stop.wait(RETRY_SECONDS)
            else:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
                for ref in ready:
                    try:
                        self._settle(pending[ref], ref)
                    except Exception:  # one engine's trouble must not end the watch over the others
                        log.exception("%s: following its Ray actor failed; trying again", pending[ref].name)
            if not self._stop.is_set():
                self._ask_lost()

    def _settle(self, engine: _Engine, ref: Any) -> None:
        asked = ref is engine.asking
        if asked:
            engine.asking = None
        else:
            engine.watching = None
        try:
            answer = ray.get(ref)
        except RayError as exc:
            answer = exc
        if isinstance(answer, dict):  # `endpoint`'s answer (`until_stopped` returns True after a stop)
            self._link(engine, answer)
        elif isinstance(answer, Exception):
            if engine.link is not None and engine.link.alive and not self._stop.is_set():
                engine.link.lose(f"its Ray actor on {engine.node} died ({type(answer).__name__}); ending its calls")
            # Asked where it is and told "dead" (not "unavailable": restarting): no restart is coming.
            if asked and isinstance(answer, ActorDiedError):
                engine.gone = True
                log.error("%s on %s is gone for good (no restarts left, or its node is lost)", engine.name,
                          engine.node)

    def _ask_lost(self) -> None:
        """Ask each engine whose link is down (and that may come back) where it is now."""
        now = time.monotonic()
        for engine in self._engines:
            lost = engine.link is not None and not engine.link.alive
            if lost and not engine.gone and engine.asking is None and now - engine.asked_at > RETRY_SECONDS:
                engine.asked_at = now
                engine.asking = engine.actor.endpoint.remote()


def new_spec(runtime, pool, log_level: int) -> EngineSpec:
    """The spec every engine actor gets (its name is set per actor), with a fresh link key."""
    return EngineSpec("engine", secrets.token_bytes(32), runtime, pool, log_level=log_level)
