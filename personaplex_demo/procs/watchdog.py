"""Notices an engine that went silent: a machine that vanished says no goodbye, and TCP (or Ray's health
checks, 15-55 s) would notice late. Every engine sends its figures several times a second, even with no call
(`PoolServer.figures_seconds`), so silence itself is the signal."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine_link import EngineLink

SILENCE_LIMIT = 1.5  # seconds without a word from a live engine (it speaks every 0.25 s)
CHECK_SECONDS = 0.1


class SilenceWatchdog:
    """One thread that gives up on every watched link (`EngineLink.lose`) silent for more than
    SILENCE_LIMIT s."""

    def __init__(self) -> None:
        self._links: list[EngineLink] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._thread.start()

    def watch(self, link: EngineLink) -> None:
        with self._lock:
            self._links = [w for w in self._links if w.alive] + [link]

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last = grace_until = time.monotonic()
        while not self._stop.wait(CHECK_SECONDS):
            with self._lock:
                links = list(self._links)
            now = time.monotonic()
            if now - last > SILENCE_LIMIT / 2:
                # This process itself stalled (swapping, a long pause): its reader threads stalled
                # too and have not caught up yet. Silence heard through a stall is no evidence.
                grace_until = now + SILENCE_LIMIT
            last = now
            if now < grace_until:
                continue
            for link in links:
                silent = now - link.heard_at
                if link.alive and silent > SILENCE_LIMIT:
                    link.lose(f"no word for {silent:.1f} s (its machine may be gone); ending its calls")
