"""The link to an engine on another machine: one Ray actor call per tick, or the engine's own
TCP channel (procs/channel.py, what `--engines ray` uses), side by side in one run.

Each tick carries what one tick carries between a media worker (or the page's process) and one
engine: N callers' microphone frames one way (int16, 1920 samples, as `Push`) and N agent frames
back (float32, 1920 samples, as `Out`). Ray: one call `tick(frames) -> outputs` on an actor (at
least what "one push and one stream item per tick" costs: a push and a stream item are two
messages, this is one round trip). Channel: the same frames as typed messages over TCP on
127.0.0.1, batched by the channel's writer thread, echoed by a process of its own.

For each N: the round trip's p50/p99 and the CPU of both processes (this one and the actor's or
the echo's), per tick and per frame, over `--ticks` ticks paced every `--every` ms.

    python bench/ray_link.py [--frames 1 4 12 32] [--ticks 200] [--write]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fmt_ms, machine, md_table, replace_section  # noqa: E402
from personaplex_demo.frame import FRAME_SAMPLES  # noqa: E402
from personaplex_demo.procs import messages as msg  # noqa: E402
from personaplex_demo.procs.channel import Channel, no_delay  # noqa: E402

log = logging.getLogger("bench.ray_link")
CLK_TCK = os.sysconf("SC_CLK_TCK")
KEY = b"bench-ray-link-key"


ABOUT = """What one tick carries between a media worker (or the page's process) and one engine: N
callers' microphone frames out (int16, as `Push`) and N agent frames back (float32, as `Out`), on
127.0.0.1, paced every 20 ms. "Ray actor call" is one call `tick(frames) -> outputs` on an actor,
one round trip (a push and a stream item per tick would be two messages); "TCP channel" is the
link `--engines ray` uses (procs/channel.py over TCP, batched by its writer thread). CPU is both
processes' (this one's and the actor's or the echo's). docs/design-notes.md § Ray engines says
what follows from it."""


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def agent_frame() -> np.ndarray:
    return np.zeros(FRAME_SAMPLES, np.float32)


class Echo:
    """The Ray actor: a tick's outputs for a tick's frames."""

    def pid(self) -> int:
        return os.getpid()

    def tick(self, frames: list[np.ndarray]) -> list[np.ndarray]:
        return [agent_frame() for _ in frames]


def echo_server(conn) -> None:
    """The channel's far side, in a process of its own: an Out for every Push."""
    from multiprocessing.connection import Listener

    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    conn.send(listener.address)
    link = listener.accept()
    no_delay(link)
    done = threading.Event()
    channel: Channel | None = None

    def on_batch(batch):
        for m in batch:
            channel.send(msg.Out(m.rid, agent_frame(), "", 0, None, 0))

    channel = Channel(link, "echo", on_batch, done.set).start()
    done.wait()


def run_ray(sizes: list[int], ticks: int, every: float) -> dict[int, tuple[list[float], float]]:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        actor = ray.remote(Echo).remote()
        pid = ray.get(actor.pid.remote())
        results = {}
        for n in sizes:
            frames = [np.zeros(FRAME_SAMPLES, np.int16) for _ in range(n)]
            for _ in range(20):
                ray.get(actor.tick.remote(frames))
            times, cpu0, far0 = [], time.process_time(), process_cpu(pid)
            for _ in range(ticks):
                t = time.perf_counter()
                ray.get(actor.tick.remote(frames))
                times.append(time.perf_counter() - t)
                time.sleep(max(0.0, every - times[-1]))
            results[n] = (times, (time.process_time() - cpu0 + process_cpu(pid) - far0) / ticks)
        return results
    finally:
        ray.shutdown()


def run_channel(sizes: list[int], ticks: int, every: float) -> dict[int, tuple[list[float], float]]:
    from multiprocessing.connection import Client

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=echo_server, args=(theirs,), daemon=True)
    server.start()
    link = Client(ours.recv(), authkey=KEY)
    no_delay(link)
    got = {"n": 0}
    arrived = threading.Event()
    want = {"n": 0}

    def on_batch(batch):
        got["n"] += len(batch)
        if got["n"] >= want["n"]:
            arrived.set()

    channel = Channel(link, "client", on_batch).start()
    results = {}
    try:
        for n in sizes:
            frames = [np.zeros(FRAME_SAMPLES, np.int16) for _ in range(n)]

            def one_tick():
                got["n"], want["n"] = 0, n
                arrived.clear()
                for rid, frame in enumerate(frames):
                    channel.send(msg.Push(rid, frame))
                arrived.wait(5.0)

            for _ in range(20):
                one_tick()
            times, cpu0, far0 = [], time.process_time(), process_cpu(server.pid)
            for _ in range(ticks):
                t = time.perf_counter()
                one_tick()
                times.append(time.perf_counter() - t)
                time.sleep(max(0.0, every - times[-1]))
            results[n] = (times, (time.process_time() - cpu0 + process_cpu(server.pid) - far0) / ticks)
    finally:
        channel.close()
        server.terminate()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 4, 12, 32], help="callers' frames per tick")
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--every", type=float, default=20.0, help="ms between ticks")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runs = {"Ray actor call": run_ray(a.frames, a.ticks, a.every / 1e3),
            "TCP channel": run_channel(a.frames, a.ticks, a.every / 1e3)}
    rows = []
    for n in a.frames:
        for name, results in runs.items():
            times, cpu = results[n]
            rows.append([n, name, fmt_ms(float(np.percentile(times, 50))), fmt_ms(float(np.percentile(times, 99))),
                         fmt_ms(cpu), fmt_ms(cpu / n)])
    body = md_table(["frames per tick", "link", "round trip p50 (ms)", "p99 (ms)", "CPU per tick (ms, both ends)",
                     "CPU per frame (ms)"], rows) + "\n\n" + ABOUT
    print(body)
    if a.write:
        replace_section("The link to a Ray engine", body, info=machine())


if __name__ == "__main__":
    main()
