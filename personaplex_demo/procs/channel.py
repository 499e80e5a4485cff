"""A `Channel` over one `multiprocessing.connection.Connection` (a socket pair to a child, or a link from
links.py) on which event loops and real-time threads never block: `send` only queues, a writer thread sends
what has queued up as one pickled batch (docs/processes.md § How they talk), a reader thread hands each batch
to `on_batch`, and `on_close` runs once when the other side goes away."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()
MAX_BATCH = 256  # messages per write; a longer backlog goes out in several writes


def daemon_threads(*targets: tuple[Callable[[], None], str]) -> list[threading.Thread]:
    """One daemon thread (not started) per (target, name)."""
    return [threading.Thread(target=target, name=name, daemon=True) for target, name in targets]


class Channel:
    def __init__(self, conn: Connection, name: str, on_batch: Callable[[list[Any]], None],
                 on_close: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.name = name
        self._on_batch = on_batch
        self._on_close = on_close
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._reader, self._writer = daemon_threads((self._read, f"{name}-reader"), (self._write, f"{name}-writer"))

    def start(self) -> Channel:
        self._reader.start()
        self._writer.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, message: Any) -> None:
        """Queue one message; never blocks. Dropped once the channel is closed."""
        if not self._closed.is_set():
            self._outbox.put(message)

    def close(self, flush_timeout: float | None = None) -> None:
        """Close both directions (idempotent). With `flush_timeout`, first give the writer that long to send
        what is queued: a process about to exit says its last word (the writer is a daemon and dies with it)."""
        if flush_timeout is not None and not self._closed.is_set():
            self._outbox.put(_STOP)  # the writer sends everything before it, then returns
            self._writer.join(flush_timeout)
        self._finish()

    # ---- threads -------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                batch = self.conn.recv()
                try:
                    self._on_batch(batch)
                except Exception:  # a bad message must not silence the channel
                    log.exception("%s: handling a message failed", self.name)
        except (EOFError, OSError):
            pass  # the other side is gone, or close() shut the socket down
        except Exception:
            log.exception("%s: receiving failed", self.name)
        self._finish()
        # Only now, with both threads done with it, may the descriptor be closed (and reused).
        self._writer.join(5.0)
        with contextlib.suppress(OSError):
            self.conn.close()

    def _write(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._send(batch)
                    return
                batch.append(item)
            if not self._send(batch):
                return

    def _send(self, batch: list[Any]) -> bool:
        try:
            self.conn.send(batch)
            return True
        except (OSError, ValueError):  # the other side is gone (or we closed)
            self._finish()
            return False

    def _finish(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._outbox.put(_STOP)
        _shutdown(self.conn)  # wakes the reader if it is blocked in recv
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:
                log.exception("%s: on_close failed", self.name)


def _shutdown(conn: Connection) -> None:
    """Shut a socket-backed connection down in both directions: a blocked recv or send returns."""
    with contextlib.suppress(OSError), socket_of(conn) as sock:  # OSError: already closed, or never connected
        sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def socket_of(conn: Connection) -> Iterator[socket.socket]:
    """A socket on the connection's descriptor (a duplicate, closed afterwards), for what
    `Connection` does not offer: socket options, shutdown."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        yield sock
    finally:
        sock.close()
