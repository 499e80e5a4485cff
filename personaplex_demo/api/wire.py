"""One accepted WebSocket's life, whatever protocol is spoken on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.websockets import WebSocket

from .outbox import Outbox
from .server_events import new_id

log = logging.getLogger(__name__)

CLOSE_SECONDS = 2.0  # for the last events to leave and the close handshake, before giving up on a client


class Wire:
    """One accepted socket's life: its messages handed to `receive` one at a time, what is sent
    queued and written by a task of its own, its tasks cancelled when it closes."""

    protocol = "api"  # for the log

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.session_id = new_id("sess")
        self.outbox = Outbox()
        self.closing = False
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
                message, audio = await self.outbox.get()
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_text(message)
                self.outbox.sent(audio)
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
            await asyncio.wait_for(self.outbox.drained(), CLOSE_SECONDS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, reason[:120]), CLOSE_SECONDS)
        if self._reader is not None:
            self._reader.cancel()

    def send(self, ev: dict[str, Any] | str | bytes, audio: bool = False) -> None:
        if not self.closing:
            self.outbox.put(ev, audio)

    def send_all(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.send(ev)

    def spawn(self, coro) -> asyncio.Task:
        """A task of this socket's, cancelled when it closes."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
