"""A `Channel` over one `multiprocessing.connection.Connection` (a socket pair to a child, or a link to a
`PoolServer`) on which event loops and real-time threads never block: `send` only queues, a writer thread
sends what has queued up as one pickled batch (docs/processes.md § How they talk), a reader thread hands
each batch to `on_batch`, and `on_close` runs once when the other side goes away.

The links to a `PoolServer` (`open_link`, `accept_link`) run `multiprocessing.connection`'s authkey handshake
with a time limit on every read and write, which its own lacks (docs/processes.md § How they talk)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class _Several(list):
    """Messages queued by one `send_many`: they join the batch together."""

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

    def send_many(self, messages: list[Any]) -> None:
        """Queue several messages that go out in one write (and one wake-up of each side)."""
        if messages and not self._closed.is_set():
            self._outbox.put(_Several(messages))

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
            batch = list(item) if type(item) is _Several else [item]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._send(batch)
                    return
                batch.extend(item) if type(item) is _Several else batch.append(item)
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
        # Both directions: wakes the reader if it is blocked in recv. OSError: closed, or never connected.
        with contextlib.suppress(OSError), socket_of(self.conn) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:
                log.exception("%s: on_close failed", self.name)


@contextlib.contextmanager
def socket_of(conn: Connection) -> Iterator[socket.socket]:
    """A socket on the connection's descriptor (a duplicate, closed afterwards), for what
    `Connection` does not offer: socket options, shutdown."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        yield sock
    finally:
        sock.close()


HANDSHAKE_SECONDS = 5.0  # to connect, authenticate and get the first message
Address = str | tuple[str, int]  # an AF_UNIX socket's path, or a TCP (host, port) between machines


def no_delay(conn: Connection) -> None:
    """TCP_NODELAY on a TCP connection (a no-op for AF_UNIX): a batch over 16 KiB goes out as two writes, and
    Nagle's algorithm would hold the body back until the other side's delayed ACK, up to 40 ms."""
    with socket_of(conn) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _io_limit(conn: Connection, seconds: float) -> None:
    """SO_RCVTIMEO and SO_SNDTIMEO on the connection's socket: a blocked read or write fails with
    an OSError after `seconds` (0: no limit). The descriptor stays blocking."""
    limit = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    with socket_of(conn) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def listen(address: Address) -> socket.socket:
    """A listening socket at `address` (a path, or (host, port) with port 0 for any free one)."""
    if isinstance(address, str):  # socket.create_server is documented for IP families only
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(address)
        sock.listen(64)
        return sock
    return socket.create_server(address, backlog=64)


def open_link(address: Address, authkey: bytes, timeout: float = HANDSHAKE_SECONDS) -> tuple[Connection, Any]:
    """Connect, authenticate both ways, and read the server's first message, within `timeout` s each step.
    Raises OSError (TimeoutError, ConnectionRefusedError...), EOFError or multiprocessing's
    AuthenticationError."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection(address, timeout)

    def client(conn: Connection) -> Any:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        return conn.recv()

    return _handshake(sock, client, timeout)


def accept_link(sock: socket.socket, authkey: bytes, first: Any) -> Connection:
    """The server's side of `open_link` on an accepted socket: authenticate, send `first`."""

    def server(conn: Connection) -> None:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        conn.send(first)

    return _handshake(sock, server, HANDSHAKE_SECONDS)[0]


def _handshake(sock: socket.socket, exchange: Callable[[Connection], Any],
               timeout: float) -> tuple[Connection, Any]:
    """`exchange` on the socket as a Connection, each read and write within `timeout`."""
    sock.settimeout(None)  # blocking again: the Connection reads the descriptor directly
    conn = Connection(sock.detach())
    try:
        no_delay(conn)
        _io_limit(conn, timeout)
        result = exchange(conn)
        _io_limit(conn, 0)
    except BaseException:
        conn.close()
        raise
    return conn, result
