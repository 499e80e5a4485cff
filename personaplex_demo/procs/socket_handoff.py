"""Hand an accepted WebSocket's TCP connection (its descriptor, with SCM_RIGHTS) and upgrade request from the
main process to a media worker, which runs uvicorn's own WebSocket protocol on it (the client never knows):
docs/processes.md § API sockets handed over; why: docs/design-notes.md § API sockets in the media workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

log = logging.getLogger(__name__)

UVICORN_VERSION = "0.55.0"  # hand_over sets WebSocketsSansIOProtocol's state as this version keeps it
MAX_REQUEST_BYTES = 64 * 1024  # one handed request with its headers (uvicorn's own limit is lower)


# ---- the main process -----------------------------------------------------------------------


def connection_of(server: Any, scope: dict[str, Any]) -> WebSocketsSansIOProtocol | None:
    """The public server's protocol instance serving the WebSocket of `scope`: the one whose scope it is (uvicorn's
    middleware rewrites a proxied client's address in place), else the only one from that client in its handshake."""
    state: ServerState | None = getattr(server, "server_state", None)
    if state is None:
        return None
    protocols = [p for p in list(state.connections) if isinstance(p, WebSocketsSansIOProtocol)]
    for protocol in protocols:
        if getattr(protocol, "scope", None) is scope:
            return protocol
    same = [p for p in protocols if not p.handshake_complete and hasattr(p, "scope")
            and (p.scope.get("client"), p.scope.get("path")) == (scope.get("client"), scope.get("path"))]
    return same[0] if len(same) == 1 else None


def hand_over(protocol: WebSocketsSansIOProtocol, channel: socket.socket, request: bytes, meta: dict[str, Any]) -> None:
    """Pass the connection `protocol` serves, with its `request` and `meta` (plain JSON values), over
    `channel`; `protocol` never touches it again. OSError (the connection stays here) when the other side
    cannot take it now. The client sends nothing before the handshake's answer, so nothing of it was read
    here; closing this process's descriptor (not shutting the connection down) leaves it to the one passed."""
    payload = json.dumps(meta).encode() + b"\n" + request
    if len(payload) > MAX_REQUEST_BYTES:
        raise OSError("the request's headers are too large to hand over")
    transport = protocol.transport
    transport.pause_reading()
    fd = os.dup(transport.get_extra_info("socket").fileno())
    try:
        socket.send_fds(channel, [payload], [fd])
    except OSError:
        transport.resume_reading()
        raise
    finally:
        os.close(fd)
    # Done as far as uvicorn is concerned: the ASGI app may return without a handshake, and
    # closing sends nothing (no 500, no close frame).
    protocol.handshake_complete = True
    protocol.close_sent = True
    transport.abort()


def request_bytes(scope: dict[str, Any]) -> bytes:
    """The upgrade request as the client sent it (method line and headers), from its ASGI scope."""
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    lines = [b"GET " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in scope["headers"]]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# ---- the worker -------------------------------------------------------------------------------


class _HandedProtocol(WebSocketsSansIOProtocol):
    """uvicorn's protocol on a handed connection, which says once when the connection is gone."""

    def __init__(self, config: uvicorn.Config, state: ServerState, meta: dict[str, Any],
                 on_closed: Callable[[dict[str, Any]], None], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config, state, {"handoff": meta}, _loop=loop)
        self.meta, self.on_closed = meta, on_closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # In the scope's state (copied into the scope at the handshake): the socket, whose send queue a
        # door asks the kernel for (api/wire.py `kernel_send_queue`).
        self.app_state["socket"] = transport.get_extra_info("socket")

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.on_closed(self.meta)


class WorkerSockets:
    """The worker's side: serves each handed connection with `app`, which finds the hand-over's `meta` in
    `scope["state"]["handoff"]` and the connection's socket in `scope["state"]["socket"]`; `on_closed(meta)`
    once each connection is gone (or never arrived whole)."""

    def __init__(self, channel: socket.socket, app: Callable, on_closed: Callable[[dict[str, Any]], None]) -> None:
        self.channel = channel
        self.on_closed = on_closed
        # The public server's settings (Gradio's uvicorn.Config), less its logging set-up.
        self.config = uvicorn.Config(app, ws="websockets-sansio", lifespan="off", log_config=None, proxy_headers=False)
        self.config.load()
        self.state = ServerState()
        self.loop = asyncio.get_running_loop()
        channel.setblocking(False)
        self.loop.add_reader(channel.fileno(), self._receive)

    def _receive(self) -> None:
        while True:
            try:
                payload, fds, _, _ = socket.recv_fds(self.channel, MAX_REQUEST_BYTES, 4)
            except BlockingIOError:
                return
            except OSError:  # the main process is gone: the worker stops through its channel
                payload, fds = b"", []
            if not payload and not fds:
                self.loop.remove_reader(self.channel.fileno())
                return
            for extra in fds[1:]:
                os.close(extra)
            if fds:
                self._serve(fds[0], payload)

    def _serve(self, fd: int, payload: bytes) -> None:
        head, _, request = payload.partition(b"\n")
        try:
            meta = json.loads(head)
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError):
            log.warning("a handed connection came with an unreadable message; closed")
            os.close(fd)
            return
        protocol = _HandedProtocol(self.config, self.state, meta, self.on_closed, self.loop)
        self.loop.create_task(self._connect(sock, protocol, request))

    async def _connect(self, sock: socket.socket, protocol: _HandedProtocol, request: bytes) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, sock)
        except OSError as exc:  # the client left while its connection changed hands
            log.info("a handed connection was gone on arrival: %s", exc)
            sock.close()
            self.on_closed(protocol.meta)
            return
        protocol.data_received(request)  # the handshake goes on as if it had just been read here

    async def close(self, timeout: float) -> None:
        """End what is still open (as uvicorn does at shutdown: close 1012) and stop receiving."""
        with contextlib.suppress(OSError, ValueError):
            self.loop.remove_reader(self.channel.fileno())
        for protocol in list(self.state.connections):
            protocol.shutdown()
        if self.state.tasks:
            await asyncio.wait(list(self.state.tasks), timeout=timeout)
        self.channel.close()


def check_uvicorn() -> None:
    """`hand_over` relies on uvicorn's protocol state as kept in UVICORN_VERSION."""
    if uvicorn.__version__ != UVICORN_VERSION:
        log.warning("uvicorn %s is installed; the API sockets' hand-over was written for %s",
                    uvicorn.__version__, UVICORN_VERSION)
