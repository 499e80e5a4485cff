"""Two network namespaces joined by a veth pair: a "server" side and a "caller" side.

Needs root and `ip` (iproute2). Every address lives inside the namespaces, so nothing a test starts
there is reachable from the machine's own network, and `tc netem` on the veth shapes exactly the
traffic between the two sides. The test process reaches the server side from a thread that has
entered its namespace (`setns`), with no route from the machine's own namespace.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def missing() -> list[str]:
    """What is lacking to build the namespaces here, as words for a skip message."""
    lacking = [] if shutil.which("ip") and shutil.which("tc") else ["iproute2 (ip, tc)"]
    if os.geteuid() != 0:
        lacking.append("root (network namespaces)")
    return lacking


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def enter_namespace(name: str) -> None:
    """Move the calling thread into namespace `name` (network namespaces are per thread)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Link:
    server_ns: str
    caller_ns: str
    server_dev: str
    caller_dev: str
    server_ip: str
    caller_ip: str
    _server_thread: concurrent.futures.ThreadPoolExecutor

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def in_server_ns(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` on a thread inside the server namespace (sockets it opens live there)."""
        return self._server_thread.submit(fn, *args).result()

    def netem(self, spec: str) -> bool:
        """Shape both directions of the link, e.g. "loss 5% delay 40ms 20ms"; False when the kernel
        has no netem qdisc."""
        for ns, dev in ((self.server_ns, self.server_dev), (self.caller_ns, self.caller_dev)):
            done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                                   *spec.split()], capture_output=True, text=True)
            if "qdisc kind is unknown" in done.stderr:
                return False
            done.check_returncode()
        return True

    def clear_netem(self) -> None:
        for ns, dev in ((self.server_ns, self.server_dev), (self.caller_ns, self.caller_dev)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)

    def qdisc_stats(self, side: str = "server") -> str:
        ns, dev = (self.server_ns, self.server_dev) if side == "server" else (self.caller_ns, self.caller_dev)
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                              check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def veth_link(tag: str, subnet: str = "10.213.0") -> Iterator[Link]:
    """Namespaces `<tag>s` (server, `<subnet>.1`) and `<tag>c` (caller, `<subnet>.2`), deleted on exit
    (which also ends any process still inside and removes the veth pair)."""
    server_ns, caller_ns = f"{tag}s", f"{tag}c"
    server_dev, caller_dev = f"{tag}s0"[:15], f"{tag}c0"[:15]
    created: list[str] = []
    executor = concurrent.futures.ThreadPoolExecutor(1, initializer=enter_namespace, initargs=(server_ns,))
    try:
        for ns in (server_ns, caller_ns):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", server_dev, "netns", server_ns, "type", "veth", "peer", "name", caller_dev,
            "netns", caller_ns)
        for ns, dev, host in ((server_ns, server_dev, 1), (caller_ns, caller_dev, 2)):
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield Link(server_ns, caller_ns, server_dev, caller_dev, f"{subnet}.1", f"{subnet}.2", executor)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        for ns in created:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
