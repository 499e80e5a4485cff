"""One accepted WebSocket's life, whatever protocol is spoken on it. Linux grows a socket's send buffer
to megabytes for a client that stopped reading, so what the client has not read is counted in the kernel
too: the socket's SIOCOUTQ (tcp(7)) where the process was handed the connection, else the connection's
`tx_queue` in /proc/net/tcp(6) (proc(5)). Elsewhere than Linux the socket goes by its own queue alone."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import struct
import sys
import time
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket

from ..frame import FRAME_SECONDS
from .server_events import new_id

log = logging.getLogger(__name__)

CLOSE_SECONDS = 2.0  # for the last events to leave and the close handshake, before giving up on a client
AUDIO_EVENTS = {"response.output_audio.delta", "response.audio.delta", "session.output_audio.delta"}
AUDIO_EVENT_BYTES = 5300  # one audio delta as JSON: 80 ms of PCM16 in base64, with its ids
CHECK_SECONDS = 1.0
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
if sys.platform == "linux":
    import fcntl
    import termios

    SIOCOUTQ: int | None = termios.TIOCOUTQ  # the same request on a socket: bytes not yet acknowledged
else:
    SIOCOUTQ = None


class Wire:
    """One accepted socket's life: its messages handed to `receive` one at a time, what is sent
    queued and written by a task of its own, its tasks cancelled when it closes. `frame_bytes`: what
    one frame of agent audio weighs on the wire, to read the kernel's queue in frames."""

    protocol = "api"  # for the log
    frame_bytes = AUDIO_EVENT_BYTES

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.session_id = new_id("sess")
        self.closing = False
        self.audio_frames = 0  # audio messages queued and not yet sent
        self._outbox: asyncio.Queue[tuple[str | bytes, bool]] = asyncio.Queue()
        self._checked_at = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None

    async def receive(self, data: str | bytes | None) -> None:
        raise NotImplementedError

    async def serve(self) -> None:
        """Read until the client leaves or the socket is closed."""
        self.spawn(self._write())
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait({self._reader})
        finally:
            for task in [self._reader, *self._tasks]:
                task.cancel()

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self.receive(message.get("text", message.get("bytes")))

    async def _write(self) -> None:
        try:
            while True:
                message, audio = await self._outbox.get()
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_text(message)
                self.audio_frames -= audio
                self._outbox.task_done()
        except Exception as exc:  # the client is gone: stop reading too
            log.info("%s %s: sending failed (%s); closing", self.protocol, self.session_id,
                     type(exc).__name__)
            if self._reader is not None:
                self._reader.cancel()

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued (briefly), close the socket, stop reading."""
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), CLOSE_SECONDS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, reason[:120]), CLOSE_SECONDS)
        if self._reader is not None:
            self._reader.cancel()

    def send(self, ev: dict[str, Any] | str | bytes, audio: bool = False) -> None:
        """A JSON event (an audio delta is counted as audio), or a text or binary message (`audio` says)."""
        if self.closing:
            return
        if isinstance(ev, dict):
            audio = ev["type"] in AUDIO_EVENTS
            ev = json.dumps(ev, separators=(",", ":"))
        self._outbox.put_nowait((ev, audio))
        self.audio_frames += audio

    def send_all(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.send(ev)

    def spawn(self, coro) -> asyncio.Task:
        """A task of this socket's, cancelled when it closes."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def client_stopped_reading(self, limit_seconds: float) -> bool:
        """Once a second: whether more than `limit_seconds` of agent audio wait for the client,
        queued here or held by the kernel."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_SECONDS:
            return False
        self._checked_at = now
        kernel = kernel_send_queue(self.ws.scope) or 0
        return (self.audio_frames + kernel / self.frame_bytes) * FRAME_SECONDS > limit_seconds


def proc_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp writes it: the address in 32-bit words of host byte order
    (little-endian here), then the port, in upper-case hex."""
    packed = ipaddress.ip_address(host.split("%")[0]).packed
    words = "".join(packed[i:i + 4][::-1].hex() for i in range(0, len(packed), 4))
    return f"{words.upper()}:{port:04X}"


def kernel_send_queue(scope: dict[str, Any]) -> int | None:
    """Bytes queued in the kernel for the connection of the ASGI `scope`; None if unknown. A handed
    connection's socket is in the scope's state (procs/socket_handoff.py): one call asks it. Otherwise
    the host's TCP tables are read, once a second for all the sockets that ask, since the kernel walks
    every connection of the host to write them."""
    sock = scope.get("state", {}).get("socket")
    if sock is not None and SIOCOUTQ is not None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile (fileno -1)
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0\0\0\0"))[0]
    local, remote = scope.get("server"), scope.get("client")
    if local is None or remote is None:
        return None
    try:
        ends = (proc_address(*local), proc_address(*remote))
    except ValueError:  # not an IP address (a Unix socket, a test client)
        return None
    return _TCP.queues(TCP_TABLES[len(ends[0]) > len("7F000001:0050")]).get(ends)  # IPv6's are longer


class _TcpTables:
    """The kernel's send queue of every TCP connection of the host, each table read at most once a
    second for all the sockets that ask: each socket reading it itself would cost the process the
    square of its sockets."""

    def __init__(self) -> None:
        self._read: dict[Path, tuple[float, dict[tuple[str, str], int]]] = {}

    def queues(self, table: Path) -> dict[tuple[str, str], int]:
        now = time.monotonic()
        read_at, queues = self._read.get(table, (float("-inf"), {}))
        if now - read_at >= CHECK_SECONDS:
            queues = {}
            with contextlib.suppress(OSError):
                for fields in map(str.split, table.read_text().splitlines()[1:]):
                    if len(fields) > 4:
                        queues[(fields[1], fields[2])] = int(fields[4].split(":")[0], 16)
            self._read[table] = (now, queues)
        return queues


_TCP = _TcpTables()
