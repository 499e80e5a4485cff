"""Links to an engine's `PoolServer`. `multiprocessing.connection`'s `Client` and `Listener.accept` run the
authkey handshake without a time limit: a TCP peer lost midway (a network flap, a port scan) would hold the
server's accept thread, or the client, for good. Here it runs with one on every read and write."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from .channel import socket_of

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
    Raises OSError (TimeoutError, ConnectionRefusedError...), EOFError or multiprocessing's AuthenticationError."""
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


def _handshake(sock: socket.socket, exchange: Callable[[Connection], Any], timeout: float) -> tuple[Connection, Any]:
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
