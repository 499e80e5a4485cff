"""The API doors on the app's one port: each socket is admitted before it is accepted (a refused client
gets a plain HTTP answer, and never touches a slot; docs/realtime.md § Access), then served here or by a
media worker (docs/design-notes.md § A table of doors and the phone door)."""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from ..addresses import client_address
from ..serving.loop_lag import ensure_probe
from ..serving.room import Room
from .chat_socket import ChatDoor
from .config import ApiConfig
from .live_socket import LiveDoor
from .realtime_socket import RealtimeDoor
from .session import PromptRules
from .socket_base import ApiSocket, DoorStats, SocketDoor, deny
from .twilio_socket import TwilioDoor

log = logging.getLogger(__name__)

# The table of doors: a door is its module and its line here.
DOOR_TABLE: tuple[type[SocketDoor], ...] = (RealtimeDoor, LiveDoor, ChatDoor, TwilioDoor)
KINDS = tuple(door.kind for door in DOOR_TABLE)

# Hands an admitted socket's connection to another process (orchestration/media_workers.py): True when
# it was taken (that process serves the socket and reports its close), False to serve it here.
HandOff = Callable[[WebSocket, str, str], Awaitable[bool]]


def key_accepted(expected: str | None, presented: str | None) -> bool:
    return expected is None or presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


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


class ApiDoors:
    """The socket doors. In the main process they admit each socket and, with media workers, hand
    it over (`hand_off`); wherever a socket is served, `serve` accepts it and runs its protocol."""

    def __init__(self, room: Room, rules: PromptRules, config: ApiConfig,
                 stats: dict[str, DoorStats] | None = None) -> None:
        self.room, self.rules, self.config = room, rules, config
        self.limiter = SocketLimiter(config.max_sockets_per_client)
        self.hand_off: HandOff | None = None
        self.serving: set[ApiSocket] = set()  # the sockets this process runs, until each closes
        self.doors = {cls.kind: cls(room, rules, config, (stats or {}).get(cls.kind) or DoorStats())
                      for cls in DOOR_TABLE if cls.enabled(config)}

    def routes(self) -> list[BaseRoute]:
        routes: list[BaseRoute] = []
        for door in self.doors.values():
            routes += [WebSocketRoute(door.path, functools.partial(self._enter, door=door)), *door.routes()]
        return routes

    def served_routes(self) -> list[BaseRoute]:
        """For a process that serves sockets admitted elsewhere: accept and run, no admission."""
        return [WebSocketRoute(door.path, functools.partial(self.serve, kind=kind)) for kind, door in self.doors.items()]

    async def _enter(self, ws: WebSocket, door: SocketDoor) -> None:
        """Admit the socket (the door's check, the key, the per-client limit); serve it here or hand it over."""
        if not await door.check(ws):
            return
        address = await self._admit(ws, door)
        if address is None:
            return
        door.stats.opened()
        handed = False
        try:
            handed = self.hand_off is not None and await self.hand_off(ws, door.kind, address)
            if not handed:
                await self.serve(ws, door.kind)
        finally:
            if not handed:  # else the serving process reports the close
                self.handed_closed(door.kind, address)

    def handed_closed(self, kind: str, address: str) -> None:
        """A socket closed: served here, or by another process (or that process stopped)."""
        door = self.doors[kind]
        door.stats.closed()
        if door.keyed:
            self.limiter.give_back(address)

    async def serve(self, ws: WebSocket, kind: str) -> None:
        """Accept an admitted socket and run its protocol until it closes."""
        door = self.doors[kind]
        what, socket = door.open(ws)
        await ws.accept(subprotocol=door.subprotocol(ws))
        ensure_probe(self.room)
        log.info("%s socket from %s", what, ws.client.host if ws.client else "?")
        self.serving.add(socket)
        try:
            await socket.run()
        finally:
            self.serving.discard(socket)

    def ending_calls(self) -> bool:
        """Whether a socket that had a call is still open: at a stop, it is telling its caller why."""
        return any(socket.call is not None for socket in self.serving)

    async def _admit(self, ws: WebSocket, door: SocketDoor) -> str | None:
        """The client's address, its socket counted; None (and an HTTP answer) when refused."""
        address = client_address(ws.headers, ws.client.host if ws.client else None, self.config.trust_forwarded_for)
        if not door.keyed:
            return address
        if door.key_required() and not key_accepted(self.config.api_key, door.presented_key(ws)):
            door.stats.refuse("api_key")
            await deny(ws, 401, "invalid_api_key", "this server needs an API key: send it as "
                       "\"Authorization: Bearer <key>\" (or the openai-insecure-api-key.<key> subprotocol)")
            return None
        if not self.limiter.take(address):
            door.stats.refuse("too_many_sockets")
            await deny(ws, 429, "too_many_sockets", f"at most {self.limiter.limit} sockets may be open from one "
                       "address (every API door together); close one first")
            return None
        return address

    def status(self) -> dict[str, Any]:
        """For /api/status: each door's figures by its kind (None for a door that is off)."""
        return {cls.kind: self.doors[cls.kind].status() if cls.kind in self.doors else None for cls in DOOR_TABLE}
