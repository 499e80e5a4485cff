"""What an API door counts of itself, for /api/status and /metrics: open sockets, sockets
refused at the door, and error events by code. The room counts the calls (by door)."""

from __future__ import annotations

import collections
import threading


class DoorStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sockets_open = 0
        self.sockets_total = 0
        self.refused: collections.Counter[str] = collections.Counter()  # "api_key", "too_many_sockets"
        self.errors: collections.Counter[str] = collections.Counter()  # error events sent, by code

    def opened(self) -> None:
        with self._lock:
            self.sockets_open += 1
            self.sockets_total += 1

    def closed(self) -> None:
        with self._lock:
            self.sockets_open -= 1

    def refuse(self, why: str) -> None:
        with self._lock:
            self.refused[why] += 1

    def error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {"sockets_open": self.sockets_open, "sockets_total": self.sockets_total,
                    "refused": dict(self.refused), "errors": dict(self.errors)}
