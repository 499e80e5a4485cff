"""The app's child processes, spawned (a fresh interpreter: no CUDA state, no torch in a media worker) as
daemons with a `Channel` over a socket pair, so either side's death is an EOF to the other. A child ignores
SIGTERM and SIGINT (a signal to the process group would kill it first, like a crash): the main process stops
its children itself, in order (docs/processes.md § How they stop)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import queue
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from ..logs import configure_logging
from .channel import Channel
from .messages import Stop

log = logging.getLogger(__name__)

KILL_WAIT = 2.0  # seconds a killed child gets to exit before we stop waiting for it
ChildMain = Callable[[Any, Connection], None]  # a module-level function: spawn pickles it by name


def _child_main(target: ChildMain, spec: Any, conn: Connection, name: str, log_level: int) -> None:
    """Every child's first code: the app's logging (its name in each line) and signals, then its entry point."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the main process stops its children (the module docstring)
    configure_logging(log_level, prefix=name)
    target(spec, conn)


class Child:
    """One child process and the `Channel` to it (once `start`ed)."""

    def __init__(self, name: str, target: ChildMain, spec: Any, log_level: int = logging.INFO) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._ours, self._theirs = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_child_main, args=(target, spec, self._theirs, name, log_level),
                                   name=name, daemon=True)
        self.channel: Channel | None = None

    def start(self, on_batch: Callable[[list[Any]], None], on_close: Callable[[], None] | None = None) -> Child:
        """Spawn it; `on_batch` and `on_close` (the child exited or died, or `close`) run on the channel's reader."""
        try:
            self.process.start()
        except BaseException:
            self._ours.close()
            raise
        finally:
            self._theirs.close()  # the child's end lives in the child now: only its death closes it
        self.channel = Channel(self._ours, self.name, on_batch, on_close).start()
        return self

    def send(self, message: Any) -> None:
        if self.channel is None:
            raise RuntimeError(f"{self.name} has not been started")
        self.channel.send(message)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL (a child ignores SIGTERM: `_child_main`), then up to `KILL_WAIT` s for it to exit."""
        self.process.kill()
        self.process.join(KILL_WAIT)

    def close(self) -> None:
        """Close the channel (its `on_close` runs if it has not yet); the process is not touched."""
        if self.channel is not None:
            self.channel.close()


def stop_children(children: Sequence[Child], join_timeout: float) -> None:
    """Tell every child to `Stop` (they wind down in parallel), then kill those still there after `join_timeout` s."""
    for child in children:
        child.send(Stop())
    deadline = time.monotonic() + join_timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.alive:
            log.warning("%s did not stop within %.0f s; killing it", child.name, join_timeout)
            child.kill()
        child.close()


def kill_children() -> None:
    """SIGKILL every child still running: the last resort of an exit that cannot wait. Children ignore
    SIGTERM, so multiprocessing's exit hook (terminate, then wait without a limit) would wait forever."""
    for process in multiprocessing.active_children():
        process.kill()


# Registered after multiprocessing's own exit hook (imported above), so it runs before it.
atexit.register(kill_children)


class Inbox:
    """A channel's messages for a thread (not an event loop) that waits for them: pass `on_batch` and
    `on_close` to the Channel (or `Child.start`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def on_batch(self, batch: list[Any]) -> None:
        for message in batch:
            self._queue.put(message)

    def on_close(self) -> None:
        self._queue.put(None)

    def get(self) -> Any:
        """The next message, waiting as long as it takes; None once the channel has closed."""
        return self._queue.get()
