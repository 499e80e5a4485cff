"""Stop: a clean exit on SIGTERM or SIGINT (docs/operations.md § Restarts): every call ended with a
message and the recordings deleted within `SHUTDOWN_SECONDS`, where SIGTERM's default would kill the
process at once; a second signal exits at once."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 8.0  # within the usual 10 s a supervisor gives before SIGKILL


class StopSignals:
    """SIGTERM and SIGINT set an event for the main thread instead of killing the process (SIGTERM)
    or raising KeyboardInterrupt somewhere inside Gradio (SIGINT). Install from the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._event = threading.Event()

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set():
            log.warning("%s again during the clean-up: exiting now", name)
            os._exit(128 + signum)
        self.received = name
        self._event.set()

    def wait(self) -> str:
        """Block until a signal arrives; its name. A timed wait, so the handler runs promptly."""
        while not self._event.wait(0.5):
            pass
        return self.received or "signal"


def shut_down(steps: list[tuple[str, Callable[[], object]]], deadline_seconds: float = SHUTDOWN_SECONDS,
              on_timeout: Callable[[], object] | None = None) -> None:
    """Run the clean-up steps in order, each one logged, an exception in one not stopping the next. A
    watchdog exits (0, after `on_timeout`) past `deadline_seconds`: a stuck thread must not earn a SIGKILL."""
    finished = threading.Event()

    def watchdog() -> None:
        if finished.wait(deadline_seconds):
            return
        log.error("clean shutdown took more than %.0f s; exiting now", deadline_seconds)
        if on_timeout is not None:
            try:
                on_timeout()
            except Exception:
                log.exception("last clean-up step failed")
        exit_now(0)

    threading.Thread(target=watchdog, name="shutdown-watchdog", daemon=True).start()
    for name, step in steps:
        began = time.monotonic()
        try:
            step()
        except Exception:
            log.exception("shutdown: %s failed", name)
        log.info("shutdown: %s (%.1f s)", name, time.monotonic() - began)
    finished.set()


def exit_now(code: int = 0) -> None:
    """End the process, skipping the interpreter's finalization: with torch, PyAV and aiortc loaded it
    takes from 1 to over 20 s, past a supervisor's grace period, and has nothing left to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
