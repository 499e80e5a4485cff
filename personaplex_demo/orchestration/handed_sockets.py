"""The main process's record of the API sockets it handed to media workers (socket_handoff.py): which
worker serves each and whose socket count it holds, until the worker says it closed or stops. The
workers' error events come back here, so the door's figures count every socket wherever it runs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from ..procs import messages as msg
from ..procs import socket_handoff

log = logging.getLogger(__name__)


class HandedSockets:
    def __init__(self, workers) -> None:
        """`workers`: the MediaWorkers that serve the sockets; each worker's `sockets` maps a hand-over's
        number to its door kind and client address."""
        self.workers = workers
        self._numbers = itertools.count(1)
        self._door = None  # api/doors.py ApiDoors
        self._web_server: Callable[[], Any] = lambda: None

    def serve(self, door, web_server: Callable[[], Any]) -> None:
        """Hand `door`'s admitted sockets over; `web_server()` is the public server whose
        connections they are (uvicorn's, as Gradio runs it)."""
        socket_handoff.check_uvicorn()
        self._door, self._web_server = door, web_server
        door.hand_off = self.hand_off

    async def hand_off(self, ws, kind: str, address: str) -> bool:
        """Pass an admitted socket's connection to a worker; False (serve it here) when none can take it."""
        self.workers.on_loop()
        protocol = socket_handoff.connection_of(self._web_server(), ws.scope)
        worker = self.workers.least_loaded(lambda w: w.handoff is not None)
        if protocol is None or worker is None:
            log.warning("an API socket is served by the main process: %s", "no media worker can take it"
                        if worker is None else "its connection was not found in the web server")
            return False
        number = next(self._numbers)
        try:
            socket_handoff.hand_over(protocol, worker.handoff, socket_handoff.request_bytes(ws.scope),
                                     {"id": number, "kind": kind})
        except OSError as exc:
            log.warning("media worker %d could not take an API socket (%s); serving it here", worker.index, exc)
            return False
        worker.sockets[number] = (kind, address)
        return True

    def receive(self, worker, report: msg.SocketError | msg.SocketClosed) -> None:
        """`worker`'s word on a socket it serves: an error event it sent (for the door's counts), or
        its close."""
        match report:
            case msg.SocketError(kind=kind, code=code) if self._door is not None:
                self._door.doors[kind].stats.error(code)
            case msg.SocketClosed(handoff=number):
                self._closed(worker, number)

    def worker_gone(self, worker) -> None:
        """On the sockets' loop: `worker` stopped, and its sockets' connections with it."""
        if worker.handoff is not None:
            worker.handoff.close()
        for number in list(worker.sockets):
            self._closed(worker, number)

    def _closed(self, worker, number: int) -> None:
        handed = worker.sockets.pop(number, None)
        if handed is not None and self._door is not None:
            self._door.handed_closed(*handed)
