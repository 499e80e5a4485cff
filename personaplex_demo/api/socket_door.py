"""What the table of API doors (api/doors.py) knows of one door: its path and words, who may open
it, what it checks before a socket is accepted, and the protocol that serves an accepted socket."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from starlette.responses import JSONResponse
from starlette.routing import BaseRoute
from starlette.websockets import WebSocket

from ..serving.room import Room
from .access import SocketLimiter, presented_key
from .config import ApiConfig
from .session import PromptRules
from .socket_base import ApiSocket
from .stats import DoorStats


class Doors(Protocol):
    """What a door uses of the table's keeper (api/doors.py ApiDoors, which imports the doors)."""

    room: Room
    rules: PromptRules
    config: ApiConfig
    limiter: SocketLimiter

class SocketDoor:
    """One door of the table. Subclasses name it (`kind`, `path`, `label`) and open its sockets."""

    kind: ClassVar[str]  # its calls' label in the room, its /api/status key, its metrics' prefix
    path: ClassVar[str]
    label: ClassVar[str]  # for people: /metrics help and the log
    # Admission by the API key and a count of open sockets per client address. A door whose
    # client cannot carry a key (a phone network) admits by a check of its own instead.
    keyed: ClassVar[bool] = True

    def __init__(self, doors: Doors, stats: DoorStats) -> None:
        self.doors, self.stats = doors, stats

    @property
    def config(self) -> ApiConfig:
        return self.doors.config

    @classmethod
    def enabled(cls, config: ApiConfig) -> bool:
        return True

    def key_required(self) -> bool:
        return self.config.api_key is not None

    def presented_key(self, ws: WebSocket) -> str | None:
        return presented_key(ws.headers, list(ws.scope.get("subprotocols") or []))

    async def check(self, ws: WebSocket) -> bool:
        """Before the key and the count: False when the socket was refused (and told why) here."""
        return True

    def open(self, ws: WebSocket) -> tuple[str, ApiSocket]:
        """For an admitted socket: the words for the log and the protocol that serves it."""
        raise NotImplementedError

    def subprotocol(self, ws: WebSocket) -> str | None:
        """The subprotocol the accepted socket names (browsers fail a handshake without one they offered)."""
        return None

    def routes(self) -> list[BaseRoute]:
        """HTTP routes the door adds beside its socket's (in the main process)."""
        return []

    def status(self) -> dict[str, Any]:
        """For /api/status."""
        extra = {"max_sockets_per_client": self.doors.limiter.limit} if self.keyed else {}
        return {"path": self.path, "api_key_required": self.keyed and self.key_required(), **extra,
                **self.stats.as_dict()}


async def deny(ws: WebSocket, status: int, code: str, message: str) -> None:
    """Refuse a socket before accepting it, with an HTTP answer its client can read."""
    body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status))
    except RuntimeError:  # a server without the denial-response extension: a bare 403
        await ws.close(1008, message[:120])
