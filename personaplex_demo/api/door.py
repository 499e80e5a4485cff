"""The API doors: `/v1/realtime` (the OpenAI Realtime protocol) and `/v1/live/sessions` (OpenAI's
GPT-Live protocol) on the app's one port, beside the page (docs/realtime.md).

`RealtimeDoor` checks a socket's key and its client's socket count (one count for both paths)
before accepting it (a refused client gets a plain HTTP 401 or 429 and never reaches the room),
and hands the socket to a `RealtimeSocket` (in the dialect it speaks) or a `LiveSocket`. It also
reports both paths to /api/status and /metrics.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from ..serving.loop_lag import ensure_probe
from ..serving.room import Room
from .access import BETA_SUBPROTOCOL, SocketLimiter, client_address, key_accepted, presented_key
from .chat_socket import ERROR, POLICY, ChatSocket, chat_request
from .config import RealtimeConfig
from .errors import RealtimeError
from .live_socket import LiveSocket
from .realtime_socket import RealtimeSocket
from .session import Dialect, PromptRules
from .socket_base import ApiSocket
from .stats import DoorStats

log = logging.getLogger(__name__)

PATH = "/v1/realtime"
LIVE_PATH = "/v1/live/sessions"
CHAT_PATH = "/api/chat"


def dialect_of(headers: Any, subprotocols: list[str]) -> Dialect:
    """The beta event names for clients that ask for them (`OpenAI-Beta: realtime=v1`)."""
    beta = "realtime=v1" in headers.get("openai-beta", "").replace(" ", "") or BETA_SUBPROTOCOL in subprotocols
    return Dialect.BETA if beta else Dialect.CURRENT


# Which protocol a socket speaks, by path; the same names label the room's calls by door.
KINDS = {PATH: "realtime", LIVE_PATH: "live", CHAT_PATH: "chat"}

# Hands an admitted socket's connection to another process (procs/media_workers.py): True when
# it was taken (that process serves the socket and reports its close), False to serve it here.
HandOff = Callable[[WebSocket, str, str], Awaitable[bool]]


class RealtimeDoor:
    """The API sockets' door. In the main process it admits each socket (key, per-client count)
    and, with media workers, hands it over (`hand_off`); wherever a socket is served, `serve`
    accepts it and runs its protocol to the end."""

    def __init__(self, room: Room, rules: PromptRules, config: RealtimeConfig,
                 stats: dict[str, DoorStats] | None = None) -> None:
        self.room, self.rules, self.config = room, rules, config
        self.stats_by_kind = stats or {kind: DoorStats() for kind in KINDS.values()}
        self.stats, self.live_stats, self.chat_stats = (self.stats_by_kind[k] for k in ("realtime", "live", "chat"))
        self.limiter = SocketLimiter(config.max_sockets_per_client)
        self.hand_off: HandOff | None = None

    def routes(self) -> list[BaseRoute]:
        routes: list[BaseRoute] = [WebSocketRoute(PATH, self.endpoint), WebSocketRoute(LIVE_PATH, self.live_endpoint)]
        if self.config.chat:
            routes += [WebSocketRoute(CHAT_PATH, self.chat_endpoint), Route("/api/voices", self.voices)]
        return routes

    def served_routes(self) -> list[BaseRoute]:
        """For a process that serves sockets admitted elsewhere: accept and run, no admission."""
        return [WebSocketRoute(path, functools.partial(self.serve, kind=kind)) for path, kind in KINDS.items()]

    async def voices(self, _: Request) -> JSONResponse:
        """The reference server's voice list, as its clients read it."""
        names = [f"{voice}.pt" for voice in self.rules.voice_names]
        return JSONResponse({"voices": names, "count": len(names)})

    async def chat_endpoint(self, ws: WebSocket) -> None:
        """NVIDIA's protocol: the query is checked before anything else; a bad one is told why."""
        try:
            chat_request(ws.query_params, self.rules)
        except RealtimeError as err:
            self.chat_stats.refuse(err.code)
            await ws.accept()
            await ws.send_bytes(bytes([ERROR]) + err.message.encode())
            await ws.close(POLICY, err.message[:120])
            return
        await self._enter(ws, "chat")

    async def endpoint(self, ws: WebSocket) -> None:
        await self._enter(ws, "realtime")

    async def live_endpoint(self, ws: WebSocket) -> None:
        await self._enter(ws, "live")

    async def _enter(self, ws: WebSocket, kind: str) -> None:
        """Admit the socket (key, per-client limit); serve it here or hand it over."""
        stats = self.stats_by_kind[kind]
        address = await self._admit(ws, list(ws.scope.get("subprotocols") or []), stats)
        if address is None:
            return
        try:
            if self.hand_off is not None and await self.hand_off(ws, kind, address):
                stats.opened()
                address = None  # the serving process reports the close: `handed_closed`
                return
            stats.opened()
            try:
                await self.serve(ws, kind)
            finally:
                stats.closed()
        finally:
            if address is not None:
                self.limiter.give_back(address)

    def handed_closed(self, kind: str, address: str) -> None:
        """A socket served by another process closed (or that process stopped)."""
        self.stats_by_kind[kind].closed()
        self.limiter.give_back(address)

    async def serve(self, ws: WebSocket, kind: str) -> None:
        """Accept an admitted socket and run its protocol until it closes."""
        subprotocols = list(ws.scope.get("subprotocols") or [])
        stats = self.stats_by_kind[kind]
        if kind == "chat":
            request = chat_request(ws.query_params, self.rules)  # checked at the door
            what: str = f"chat (voice {request.voice})"
            socket: ApiSocket = ChatSocket(ws, self.room, self.config, stats, request)
        elif kind == "live":
            what, socket = "gpt-live", LiveSocket(ws, self.room, self.rules, self.config, stats)
        else:
            dialect = dialect_of(ws.headers, subprotocols)
            what = f"realtime ({dialect.value} events)"
            socket = RealtimeSocket(ws, self.room, self.rules, self.config, dialect, stats)
        # Browsers fail a handshake that does not name one of the subprotocols they offered.
        await ws.accept(subprotocol="realtime" if kind == "realtime" and "realtime" in subprotocols else None)
        ensure_probe(self.room)
        log.info("%s socket from %s", what, ws.client.host if ws.client else "?")
        await socket.run()

    async def _admit(self, ws: WebSocket, subprotocols: list[str], stats: DoorStats) -> str | None:
        """The client's address, its socket counted; None (and an HTTP answer) when refused."""
        chat = ws.url.path == CHAT_PATH  # the reference protocol's clients can send a key only in the query
        key = presented_key(ws.headers, subprotocols) or (ws.query_params.get("api_key") if chat else None)
        if not (chat and self.config.chat_without_key) and not key_accepted(self.config.api_key, key):
            stats.refuse("api_key")
            await self._deny(ws, 401, "invalid_api_key", "this server needs an API key: send it as "
                             "\"Authorization: Bearer <key>\" (or the openai-insecure-api-key.<key> subprotocol)")
            return None
        address = client_address(ws.headers, ws.client.host if ws.client else None, self.config.trust_forwarded_for)
        if not self.limiter.take(address):
            stats.refuse("too_many_sockets")
            await self._deny(ws, 429, "too_many_sockets", f"at most {self.limiter.limit} sockets may be open from "
                             "one address (Realtime and GPT-Live together); close one first")
            return None
        return address

    async def _deny(self, ws: WebSocket, status: int, code: str, message: str) -> None:
        body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
        try:
            await ws.send_denial_response(JSONResponse(body, status_code=status))
        except RuntimeError:  # a server without the denial-response extension: a bare 403
            await ws.close(1008, message[:120])

    def status(self) -> dict[str, Any]:
        """For /api/status: the Realtime path's figures."""
        return {"path": PATH, "api_key_required": self.config.api_key is not None,
                "max_sockets_per_client": self.limiter.limit, **self.stats.as_dict()}

    def live_status(self) -> dict[str, Any]:
        """For /api/status: the GPT-Live path's figures."""
        return {"path": LIVE_PATH, "api_key_required": self.config.api_key is not None,
                "max_sockets_per_client": self.limiter.limit, **self.live_stats.as_dict()}

    def chat_status(self) -> dict[str, Any]:
        """For /api/status: the /api/chat path's figures."""
        return {"path": CHAT_PATH, "api_key_required": self.config.api_key is not None and
                not self.config.chat_without_key, "max_sockets_per_client": self.limiter.limit,
                **self.chat_stats.as_dict()}

    def collectors(self) -> list[Collector]:
        return [DoorCollector(self.stats, "realtime", "Realtime API"), DoorCollector(self.live_stats, "live", "GPT-Live"),
                DoorCollector(self.chat_stats, "chat", "/api/chat (NVIDIA's protocol)")]


class DoorCollector(Collector):
    def __init__(self, stats: DoorStats, prefix: str, name: str) -> None:
        self.stats, self.prefix, self.name = stats, prefix, name

    def collect(self) -> Iterable[Metric]:
        s = self.stats.as_dict()
        yield GaugeMetricFamily(f"personaplex_{self.prefix}_sockets", f"Open {self.name} sockets.",
                                value=s["sockets_open"])
        refused = CounterMetricFamily(f"personaplex_{self.prefix}_sockets_refused",
                                      f"{self.name} sockets refused at the door, by why.", labels=["why"])
        for why in sorted({"api_key": 0, "too_many_sockets": 0, **s["refused"]}):
            refused.add_metric([why], s["refused"].get(why, 0))
        yield refused
        errors = CounterMetricFamily(f"personaplex_{self.prefix}_errors", f"Error events sent to {self.name} "
                                     "clients, by code.", labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors
