"""Start and stop: stale recordings from a crash, and a clean exit on SIGTERM or SIGINT.

A Space restarts its app with SIGTERM. Python's default for that signal kills the process at once
(exit 143): no `finally`, so live callers hear the audio stop without a word and their recordings
stay in the temp folder. Here both signals end every call with a message, stop the pool, delete
the recordings and exit 0, all within `SHUTDOWN_SECONDS`; a watchdog exits anyway if some thread
hangs. A second signal during the clean-up exits at once.

Each app's recordings folder is `personaplex-calls-<pid>-<random>` in the temp folder. At start
the folders whose process is gone (a crash, a kill -9) are removed; those of another app still
running on the same machine are kept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RECORDINGS_PREFIX = "personaplex-calls-"
SHUTDOWN_SECONDS = 8.0  # within the usual 10 s a supervisor gives before SIGKILL
LEGACY_MAX_AGE_SECONDS = 3600.0  # folders named without a pid are removed once untouched this long
_OWNED = re.compile(re.escape(RECORDINGS_PREFIX) + r"(\d+)-")


def recordings_prefix() -> str:
    """The name prefix of this process's recordings folder."""
    return f"{RECORDINGS_PREFIX}{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_recordings(tmpdir: str | Path | None = None, now: float | None = None) -> list[Path]:
    """Delete recordings folders whose process has exited; returns what was removed.

    A pid can be reused by an unrelated process: its folder then waits for the next start after
    that process exits. Folders named without a pid (older versions) go once untouched for an hour,
    past the age at which a running app deletes its recordings anyway."""
    root = Path(tmpdir) if tmpdir is not None else Path(tempfile.gettempdir())
    now = time.time() if now is None else now
    removed = []
    for path in root.glob(f"{RECORDINGS_PREFIX}*"):
        try:
            if not path.is_dir() or path.is_symlink():
                continue
            owner = _OWNED.match(path.name)
            if owner is not None:
                if int(owner.group(1)) == os.getpid() or _alive(int(owner.group(1))):
                    continue
            elif now - path.stat().st_mtime < LEGACY_MAX_AGE_SECONDS:
                continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        log.info("removed %d recordings folder(s) left by exited processes", len(removed))
    return removed


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
    """Run the clean-up steps in order, each one logged, an exception in one not stopping the next.

    A watchdog ends the process (exit 0, after `on_timeout`, e.g. deleting the recordings) if the
    steps take longer than `deadline_seconds`: a hung engine call or a stuck thread must not turn a
    restart into a SIGKILL."""
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
    """End the process once the clean-up is done, skipping the interpreter's own finalization: with
    torch, PyAV and aiortc loaded it was measured to take from 1 to over 20 s, past a supervisor's
    grace period, and there is nothing left for it to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def wait_until(predicate: Callable[[], bool], seconds: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
