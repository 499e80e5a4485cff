"""Which process runs what: the engine(s), their slot pools and the media path, in one of the
shapes of docs/processes.md § Shapes. Whatever the shape, the app has one room and one queue, in the
main process."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..api.config import ApiConfig
from ..procs.engine_link import EngineLink
from ..procs.pool_router import PoolRouter
from ..runtime.build import RuntimeOptions, build_runtime
from ..serving.config import PoolConfig
from ..serving.pool import SlotPool
from ..serving.room import Room
from .engine_process import EngineProcesses, EngineSpec, RemoteRuntime
from .media_worker import WorkerSpec
from .media_workers import MediaWorkers

log = logging.getLogger(__name__)

IPC_BASE_CHARS = 60  # + "/personaplex-ipc-XXXXXXXX/engine-NN.sock" stays under AF_UNIX's 108 bytes
WORKERS_READY_SECONDS = 180.0  # a media worker imports gradio, fastrtc and aiortc: seconds on a busy host


def resolve_devices(devices: str | None, device: str) -> list[str]:
    """`--devices` as a list: "all" is every CUDA GPU (or the CPU without one); unset is `--device`."""
    if not devices:
        return [device]
    if devices.strip() == "all":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            log.warning("--devices all: torch sees no CUDA GPU; running one engine on the CPU")
            return ["cpu"]
        return [f"cuda:{i}" for i in range(count)]
    found = [d.strip() for d in devices.split(",") if d.strip()]
    if not found:
        raise ValueError(f"--devices {devices!r}: give a comma-separated list such as cuda:0,cuda:1, or all")
    return found


def default_media_workers(devices: list[str], slots_total: int) -> int:
    """How many processes carry the callers' media without `--media-workers` (in a worker, packets never wait
    behind the page's HTTP work): on a CUDA host one per spare core (two stay with the page and the engine);
    on a CPU, whose engine needs the cores, one per four; never more than slots, none on a single core."""
    cores = os.cpu_count() or 1
    cuda = any(d.startswith("cuda") for d in devices)
    if not cuda and "auto" in devices:
        import torch

        cuda = torch.cuda.is_available()
    if cores < 2:
        return 0
    return max(1, min(cores - 2 if cuda else cores // 4, slots_total))


def ipc_directory() -> Path:
    """A new private folder (0700: only this user reaches the sockets) for the engines' AF_UNIX
    sockets. Their paths hold about 100 bytes at most, so a long TMPDIR gives way to /tmp."""
    base = tempfile.gettempdir()
    if len(base) > IPC_BASE_CHARS and os.path.isdir("/tmp"):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="personaplex-ipc-", dir=base))


@dataclass(frozen=True)
class TopologyOptions:
    runtime: RuntimeOptions  # the model, dtype, slots per engine...; the device comes from `devices`
    pool: PoolConfig
    devices: tuple[str, ...] = ("auto",)
    media_workers: int = 0
    server_rtc_configuration: dict[str, Any] | None = None
    engines: str = "local"  # local: on this machine (`devices`); ray: actors on a Ray cluster (orchestration/ray/)
    ray_address: str | None = None  # None: start a Ray on this machine
    api: ApiConfig | None = None  # the API sockets' door, served by the media workers when there are any


@dataclass
class Topology:
    """What `start_topology` started. `end_calls(join_timeout)`: every engine ends its calls with reason
    "shutdown" and stops ticking; the processes keep running until `close`, so the news reaches the pages."""

    runtime: Any  # a runtime.facts.RuntimeFacts
    room: Room
    media: MediaWorkers | None
    closers: list[Callable[[], object]]  # in the order things started: they stop in reverse, the media first
    end_calls: Callable[..., None]
    engine_status: Callable[[], list[dict[str, Any]]]  # a row per engine for /api/status

    def status(self) -> dict[str, Any]:
        """Per engine and per media worker, for /api/status (the totals are the pool's)."""
        return {"engines": self.engine_status(), "media_workers": self.media.status() if self.media is not None else []}

    def close(self) -> None:
        """Stop everything this topology started (idempotent)."""
        closers, self.closers = self.closers, []
        _close_all(closers)


def _close_all(closers: list[Callable[[], object]]) -> None:
    for close in reversed(closers):
        try:
            close()
        except Exception:
            log.exception("shutting down %s failed", getattr(close, "__qualname__", close))


def start_topology(options: TopologyOptions, progress: Callable[[str, float], None]) -> Topology:
    """Start the engines and the media workers; on a failure, stop whatever had started."""
    closers: list[Callable[[], object]] = []
    try:
        topology, engines = (_start_ray if options.engines == "ray" else _start_local)(options, progress, closers)
        if topology.media is not None:
            topology.media.serve_queue(topology.room)
            topology.media.wait_ready(WORKERS_READY_SECONDS)
    except BaseException:
        _close_all(closers)
        raise
    log.info("engines: %s; media: %s", engines,
             f"{options.media_workers} worker process(es)" if topology.media is not None else "in this process")
    return topology


def _start_local(options: TopologyOptions, progress: Callable[[str, float], None], closers: list
                 ) -> tuple[Topology, str]:
    """One engine in this process, or an engine process per device; the engines' names."""
    devices = list(options.devices)
    if len(devices) == 1 and not options.media_workers:
        runtime = build_runtime(replace(options.runtime, device=devices[0]), progress)
        pool = SlotPool(runtime.engine, runtime.pool_config(options.pool))
        pool.start()
        closers.append(pool.shutdown)
        name = f"engine-0 ({runtime.device})"
        return Topology(runtime, pool, None, closers, pool.shutdown,
                        functools.partial(_pool_status, name, str(runtime.device), pool)), name
    ipc_dir = ipc_directory()
    closers.append(functools.partial(shutil.rmtree, ipc_dir, ignore_errors=True))
    authkey = secrets.token_bytes(32)
    names = [f"engine-{i} ({d})" for i, d in enumerate(devices)]
    addresses = [str(ipc_dir / f"engine-{i}.sock") for i in range(len(devices))]
    # Several CPU engines share the cores; one keeps torch's own choice (or OMP_NUM_THREADS).
    cpu_engines = sum(1 for d in devices if not d.startswith("cuda"))
    threads = max(1, (os.cpu_count() or 1) // cpu_engines) if cpu_engines > 1 else None
    level = logging.getLogger().getEffectiveLevel()
    engines = EngineProcesses([EngineSpec(name, authkey, options.runtime, options.pool, device=device,
                                          address=address, torch_threads=threads, log_level=level)
                               for name, device, address in zip(names, devices, addresses, strict=True)]).start()
    closers.append(engines.close)
    media = None
    if options.media_workers:  # they import their libraries while the engines load the model
        media = _media_workers(options, tuple(addresses), authkey)
        closers.append(media.close)
    progress(f"loading {len(devices)} engine(s)", 0.1)
    facts = engines.wait_ready()
    runtime = RemoteRuntime.from_facts(facts[0], facts[1:])
    router = PoolRouter([EngineLink(a, authkey) for a in addresses], rules=runtime.engine)
    closers.append(router.close)
    return Topology(runtime, router, media, closers, engines.end_calls, router.engine_status), ", ".join(names)


def _start_ray(options: TopologyOptions, progress: Callable[[str, float], None], closers: list
               ) -> tuple[Topology, str]:
    """`--engines ray`: the engines are actors on a Ray cluster; this process (and its media
    workers) link to each over TCP. Ray is imported here only."""
    from .ray.engines import RayEngines, connect, new_spec

    level = logging.getLogger().getEffectiveLevel()
    engines = RayEngines(new_spec(options.runtime, options.pool, level), connect(options.ray_address, level))
    closers.append(engines.close)
    engines.start()
    progress("loading the engines on the Ray cluster", 0.1)
    router = engines.wait_ready()
    facts = engines.facts()
    runtime = RemoteRuntime.from_facts(facts[0], facts[1:])
    router.rules = runtime.engine
    media = None
    if options.media_workers:
        media = _media_workers(options, tuple(e.address for e in router.engines), engines.spec.authkey)
        closers.append(media.close)
        engines.on_relink = media.relink
    names = ", ".join(f"{e.name} on {e.facts['node']}" for e in router.engines)
    return Topology(runtime, router, media, closers, engines.end_calls, engines.status), f"{names} (Ray actors)"


def _pool_status(name: str, device: str, pool: SlotPool) -> list[dict[str, Any]]:
    """/api/status's engine row for the one engine in this process."""
    return [{"name": name, "node": socket.gethostname(), "device": device, "alive": not pool.closed,
             **pool.snapshot().as_dict()}]


def _media_workers(options: TopologyOptions, engines: tuple, authkey: bytes) -> MediaWorkers:
    return MediaWorkers(options.media_workers, WorkerSpec(
        index=0, engines=engines, authkey=authkey, recordings_dir="",
        server_rtc_configuration=options.server_rtc_configuration,
        log_level=logging.getLogger().getEffectiveLevel(), api=options.api)).start()
