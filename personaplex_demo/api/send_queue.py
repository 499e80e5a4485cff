"""How much a client has not read yet of what was sent to it over TCP.

A WebSocket send only waits once the kernel's send buffer is full, and Linux grows that buffer
to megabytes (a minute of agent audio) for a client that stopped reading. So the door also asks
the kernel: /proc/net/tcp (and tcp6) lists each connection's `tx_queue`, the bytes sent and not
yet acknowledged by the peer (proc(5)). The connection is found by its two addresses, which the
ASGI scope carries. Elsewhere than Linux this gives None, and the door goes by its own queue
alone (and the server's keepalive pings).
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

log = logging.getLogger(__name__)

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def proc_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp writes it: the address in 32-bit words of host byte order
    (little-endian here), then the port, in upper-case hex."""
    packed = ipaddress.ip_address(host.split("%")[0]).packed
    words = "".join(packed[i:i + 4][::-1].hex() for i in range(0, len(packed), 4))
    return f"{words.upper()}:{port:04X}"


def kernel_send_queue(local: tuple[str, int] | None, remote: tuple[str, int] | None) -> int | None:
    """Bytes queued in the kernel for the connection `local` -> `remote`; None if unknown."""
    if local is None or remote is None:
        return None
    try:
        ends = (proc_address(*local), proc_address(*remote))
    except ValueError:  # not an IP address (a Unix socket, a test client)
        return None
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 4 and (fields[1], fields[2]) == ends:
                return int(fields[4].split(":")[0], 16)
    return None
