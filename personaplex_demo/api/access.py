"""Who may open an API socket: the API key (when one is set) and a limit of sockets per
client address, both checked before the socket is accepted, so a refused client never touches
a slot (docs/realtime.md § Access)."""

from __future__ import annotations

import collections
import hmac
import threading
from collections.abc import Mapping, Sequence

# Browsers cannot set headers on a WebSocket; they pass the key as a subprotocol instead.
KEY_SUBPROTOCOL = "openai-insecure-api-key."
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


def presented_key(headers: Mapping[str, str], subprotocols: Sequence[str]) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, else the browsers' subprotocol."""
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return next((proto.removeprefix(KEY_SUBPROTOCOL) for proto in subprotocols if proto.startswith(KEY_SUBPROTOCOL)),
                None)


def key_accepted(expected: str | None, presented: str | None) -> bool:
    return expected is None or (presented is not None and hmac.compare_digest(expected.encode(), presented.encode()))


class SocketLimiter:
    """Open sockets per client address, at most `limit` each. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def take(self, address: str) -> bool:
        with self._lock:
            if self._open[address] >= self.limit:
                return False
            self._open[address] += 1
            return True

    def give_back(self, address: str) -> None:
        with self._lock:
            self._open[address] -= 1
            if self._open[address] <= 0:
                del self._open[address]
