"""Engine processes: one engine and its SlotPool per device, each in a process of its own.

With `--devices cuda:0,cuda:1` (or `cpu,cpu` on a machine without a GPU) the main process spawns
one `run_engine` per device. Each loads the model on its device, starts its SlotPool and serves
it with an `EngineServer`; the callers' handlers (in the main process or in media workers) reach
all of them through an `EngineRouter`. The main process itself loads no model: the page needs
only each engine's facts (`page_facts`) and the tokenizer, to count a persona's tokens.
"""

from __future__ import annotations

import logging
import multiprocessing
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..runtime.build import Runtime, RuntimeOptions
from ..serving.config import PoolConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    device: str
    address: str
    authkey: bytes
    runtime: RuntimeOptions
    pool: PoolConfig
    torch_threads: int | None = None  # several CPU engines share the cores
    log_level: int = logging.INFO


def page_facts(runtime: Runtime) -> dict[str, Any]:
    """What the page and the media workers need to know about an engine (plain data)."""
    engine = runtime.engine
    return {"model_name": runtime.model_name, "is_tiny": runtime.is_tiny, "banner": runtime.banner,
            "voice_names": list(engine.voice_names), "max_persona_tokens": engine.max_persona_tokens,
            "tokenizer_path": str(runtime.source.tokenizer_path), "device": str(runtime.device)}


def run_engine(spec: EngineSpec, control) -> None:
    """An engine process's entry point: load, serve, and stop when told (or when the main
    process goes away)."""
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s {spec.name} %(name)s: %(message)s")
    import torch

    from ..runtime.build import build_runtime
    from ..runtime.hub import install_secret_filter
    from ..serving.pool import SlotPool
    from .pool_server import EngineServer

    install_secret_filter()
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        runtime = build_runtime(replace(spec.runtime, device=spec.device))
        pool = SlotPool(runtime.engine, spec.pool)
        facts = page_facts(runtime)
        server = EngineServer(pool, spec.address, spec.authkey, name=spec.name, info=facts)
    except Exception as exc:
        control.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    pool.start()
    server.start()
    control.send(("ready", facts))
    try:
        # "end_calls": the pool ends its calls, and the server stays up to tell the callers;
        # "stop", or EOF when the main process is gone: everything stops.
        while control.recv()[0] == "end_calls":
            pool.shutdown(join_timeout=3.0)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        pool.shutdown()
        server.close()


class EngineProcesses:
    """The main process's handle on its engine processes."""

    def __init__(self, specs: list[EngineSpec]) -> None:
        self.specs = specs
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[tuple[multiprocessing.process.BaseProcess, Any]] = []

    def start(self) -> EngineProcesses:
        for spec in self.specs:
            ours, theirs = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=run_engine, args=(spec, theirs), name=spec.name, daemon=True)
            proc.start()
            theirs.close()
            self._procs.append((proc, ours))
        return self

    def wait_ready(self) -> list[dict[str, Any]]:
        """Each engine's page facts, once all have loaded; raises if one failed."""
        facts = []
        for spec, (proc, conn) in zip(self.specs, self._procs, strict=True):
            try:
                message = conn.recv()
            except EOFError:
                proc.join(1.0)
                raise RuntimeError(f"{spec.name} ({spec.device}) exited while loading (exit code "
                                   f"{proc.exitcode})") from None
            if message[0] != "ready":
                log.error("%s failed to load:\n%s", spec.name, message[2])
                raise RuntimeError(f"{spec.name} ({spec.device}) failed to load: {message[1]}")
            facts.append(message[1])
        return facts

    def end_calls(self, join_timeout: float = 3.0) -> None:
        """Each engine ends its calls with reason "shutdown" and stops ticking (see `run_engine`)."""
        for _, conn in self._procs:
            try:
                conn.send(("end_calls",))
            except OSError:
                pass

    def alive(self) -> list[bool]:
        return [proc.is_alive() for proc, _ in self._procs]

    def close(self) -> None:
        for _, conn in self._procs:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc, conn in self._procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            conn.close()


class PageEngine:
    """The engine, as far as the page needs it (voices, persona token counting), from facts."""

    def __init__(self, facts: dict[str, Any]) -> None:
        from ..runtime.tokenizer import TextTokenizer

        self.voice_names: list[str] = list(facts["voice_names"])
        self.max_persona_tokens: int = int(facts["max_persona_tokens"])
        self.tokenizer = TextTokenizer(Path(facts["tokenizer_path"]))

    def persona_tokens(self, persona: str) -> list[int]:
        from ..engine.pcm import persona_token_ids

        return persona_token_ids(self.tokenizer, persona, self.max_persona_tokens)


@dataclass
class PageRuntime:
    """`build_ui`'s runtime when the engines run in other processes."""

    engine: PageEngine
    model_name: str
    is_tiny: bool
    banner: str | None

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> PageRuntime:
        return cls(PageEngine(facts), facts["model_name"], bool(facts["is_tiny"]), facts["banner"])
