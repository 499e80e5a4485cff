"""What the API sockets' once-a-second look at the kernel's send queue (api/wire.py
`kernel_send_queue`) costs a process with many sockets: N loopback WebSocket-like TCP connections
are opened, and for `--seconds` each one's queue is asked for once a second, as each socket's
`client_stopped_reading` does. The CPU of those checks, per second, for this code and for the code
in `--compare DIR`, each in a process of its own.

    python bench/tcp_tables.py --sockets 16 64 256 --compare DIR [--write]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(root: str, sockets: int, seconds: int) -> dict:
    sys.path.insert(0, root)
    from personaplex_demo.api.wire import kernel_send_queue

    server = socket.create_server(("127.0.0.1", 0), backlog=sockets)
    pairs = []
    for _ in range(sockets):
        client = socket.create_connection(server.getsockname())
        pairs.append((client, server.accept()[0]))
    ends = [(c.getsockname(), c.getpeername()) for c, _ in pairs]
    lines = len(Path("/proc/net/tcp").read_text().splitlines()) - 1
    cpu = 0.0
    for _ in range(seconds):
        began = time.thread_time()
        for local, remote in ends:
            kernel_send_queue(local, remote)
        cpu += time.thread_time() - began
        time.sleep(1.0)
    return {"cpu_per_second": cpu / seconds, "lines": lines}


def run(root: Path, sockets: int, seconds: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(root), "--sockets", str(sockets),
                          "--seconds", str(seconds)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sockets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--compare", default=None, metavar="DIR", help="a checkout of another version")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.sockets[0], args.seconds)))
        return

    sys.path.insert(0, str(REPO))
    from bench.common import command_line, md_table, replace_section

    versions = [("this", REPO)] + ([("compared", Path(args.compare).resolve())] if args.compare else [])
    rows = []
    for n in args.sockets:
        for name, root in versions:  # the versions side by side at each count
            r = run(root, n, args.seconds)
            rows.append([name, n, r["lines"], f"{1e3 * r['cpu_per_second']:.1f}",
                         f"{1e6 * r['cpu_per_second'] / n:.0f}", f"{r['cpu_per_second']:.3f}"])
    body = md_table(["version", "sockets", "lines in /proc/net/tcp", "CPU per second (ms)", "per socket (µs)",
                     "of one core"], rows)
    print(body)
    if args.write:
        replace_section("API sockets: the kernel's send queues", body, command=command_line())


if __name__ == "__main__":
    main()
