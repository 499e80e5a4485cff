"""The Realtime door: `/v1/realtime` on the app's one port, beside the page (docs/realtime.md).

`RealtimeDoor` checks a socket's key and its client's socket count before accepting it (a
refused client gets a plain HTTP 401 or 429 and never reaches the room), picks the dialect it
speaks, and hands the socket to a `RealtimeSocket`. It also reports itself to /api/status and
/metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from ..serving.loop_lag import ensure_probe
from ..serving.room import Room
from .access import BETA_SUBPROTOCOL, SocketLimiter, client_address, key_accepted, presented_key
from .config import RealtimeConfig
from .realtime_socket import RealtimeSocket
from .session import Dialect, PromptRules
from .stats import DoorStats

log = logging.getLogger(__name__)

PATH = "/v1/realtime"


def dialect_of(headers: Any, subprotocols: list[str]) -> Dialect:
    """The beta event names for clients that ask for them (`OpenAI-Beta: realtime=v1`)."""
    beta = "realtime=v1" in headers.get("openai-beta", "").replace(" ", "") or BETA_SUBPROTOCOL in subprotocols
    return Dialect.BETA if beta else Dialect.CURRENT


class RealtimeDoor:
    def __init__(self, room: Room, rules: PromptRules, config: RealtimeConfig) -> None:
        self.room, self.rules, self.config = room, rules, config
        self.stats = DoorStats()
        self.limiter = SocketLimiter(config.max_sockets_per_client)

    def routes(self) -> list[WebSocketRoute]:
        return [WebSocketRoute(PATH, self.endpoint)]

    async def endpoint(self, ws: WebSocket) -> None:
        subprotocols = list(ws.scope.get("subprotocols") or [])
        if not key_accepted(self.config.api_key, presented_key(ws.headers, subprotocols)):
            self.stats.refuse("api_key")
            await self._deny(ws, 401, "invalid_api_key", "this server needs an API key: send it as "
                             "\"Authorization: Bearer <key>\" (or the openai-insecure-api-key.<key> subprotocol)")
            return
        address = client_address(ws.headers, ws.client.host if ws.client else None, self.config.trust_forwarded_for)
        if not self.limiter.take(address):
            self.stats.refuse("too_many_sockets")
            await self._deny(ws, 429, "too_many_sockets", f"at most {self.limiter.limit} sockets may be open from "
                             "one address; close one first")
            return
        try:
            dialect = dialect_of(ws.headers, subprotocols)
            # Browsers fail a handshake that does not name one of the subprotocols they offered.
            await ws.accept(subprotocol="realtime" if "realtime" in subprotocols else None)
            ensure_probe(self.room)
            log.info("realtime socket from %s (%s events)", address, dialect.value)
            await RealtimeSocket(ws, self.room, self.rules, self.config, dialect, self.stats).run()
        finally:
            self.limiter.give_back(address)

    async def _deny(self, ws: WebSocket, status: int, code: str, message: str) -> None:
        body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
        try:
            await ws.send_denial_response(JSONResponse(body, status_code=status))
        except RuntimeError:  # a server without the denial-response extension: a bare 403
            await ws.close(1008, message[:120])

    def status(self) -> dict[str, Any]:
        """For /api/status."""
        return {"path": PATH, "api_key_required": self.config.api_key is not None,
                "max_sockets_per_client": self.limiter.limit, **self.stats.as_dict()}

    def collector(self) -> Collector:
        return DoorCollector(self.stats)


class DoorCollector(Collector):
    def __init__(self, stats: DoorStats) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats.as_dict()
        yield GaugeMetricFamily("personaplex_realtime_sockets", "Open Realtime API sockets.",
                                value=s["sockets_open"])
        refused = CounterMetricFamily("personaplex_realtime_sockets_refused",
                                      "Realtime API sockets refused at the door, by why.", labels=["why"])
        for why in sorted({"api_key": 0, "too_many_sockets": 0, **s["refused"]}):
            refused.add_metric([why], s["refused"].get(why, 0))
        yield refused
        errors = CounterMetricFamily("personaplex_realtime_errors", "Error events sent to Realtime API clients, "
                                     "by code.", labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors
