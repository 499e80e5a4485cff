"""What the API sockets' once-a-second look at the kernel's send queue (api/wire.py
`kernel_send_queue`) costs a process with many sockets: N loopback TCP connections are opened, and
for `--seconds` each one's queue is asked for once a second, as each socket's `client_stopped_reading`
does: of the socket itself, as a media worker does with a handed connection, and from the host's
TCP tables, as the main process does. The CPU of those checks, per second, for this code and for
the code in `--compare DIR`, each case in a process of its own.

    python bench/tcp_tables.py --sockets 16 64 256 --compare DIR [--write]
"""

from __future__ import annotations

import argparse
import inspect
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(root: str, sockets: int, seconds: int, handed: bool) -> dict:
    sys.path.insert(0, root)
    from personaplex_demo.api.wire import kernel_send_queue

    if len(inspect.signature(kernel_send_queue).parameters) == 2:  # a version that took the two addresses
        ask = lambda c: kernel_send_queue(c.getsockname(), c.getpeername())  # noqa: E731
    else:  # the ASGI scope: a handed connection's has the socket in its state
        ask = lambda c: kernel_send_queue({"server": c.getsockname(), "client": c.getpeername(),  # noqa: E731
                                           "state": {"socket": c} if handed else {}})

    server = socket.create_server(("127.0.0.1", 0), backlog=sockets)
    pairs = []
    for _ in range(sockets):
        client = socket.create_connection(server.getsockname())
        pairs.append((client, server.accept()[0]))
    lines = len(Path("/proc/net/tcp").read_text().splitlines()) - 1
    cpu = 0.0
    for _ in range(seconds):
        began = time.thread_time()
        for client, _ in pairs:
            ask(client)
        cpu += time.thread_time() - began
        time.sleep(1.0)
    return {"cpu_per_second": cpu / seconds, "lines": lines}


def run(root: Path, sockets: int, seconds: int, handed: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(root), "--sockets", str(sockets),
                          "--seconds", str(seconds)] + (["--handed"] if handed else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sockets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--compare", default=None, metavar="DIR", help="a checkout of another version")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--handed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.sockets[0], args.seconds, args.handed)))
        return

    sys.path.insert(0, str(REPO))
    from bench.common import command_line, md_table, replace_section

    cases = [("this", "a handed socket", REPO, True), ("this", "the TCP tables", REPO, False)]
    if args.compare:
        cases.append(("compared", "the TCP tables", Path(args.compare).resolve(), False))
    rows = []
    for n in args.sockets:
        for name, path, root, handed in cases:  # side by side at each count
            r = run(root, n, args.seconds, handed)
            rows.append([name, path, n, r["lines"], f"{1e3 * r['cpu_per_second']:.1f}",
                         f"{1e6 * r['cpu_per_second'] / n:.0f}", f"{r['cpu_per_second']:.3f}"])
    body = md_table(["version", "asked of", "sockets", "lines in /proc/net/tcp", "CPU per second (ms)",
                     "per socket (µs)", "of one core"], rows)
    print(body)
    if args.write:
        replace_section("API sockets: the kernel's send queues", body, command=command_line())


if __name__ == "__main__":
    main()
