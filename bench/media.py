"""Callers per host: real WebRTC callers against the app as a user starts it.

For each caller count N, this starts `python app.py --model tiny` (one torch thread) on a free
port and connects N aiortc peers over loopback. Each peer drives the page's own Gradio events as
the browser page does: `start_recording` when the call starts, the WebRTC component's `turn` and
`offer` server functions through `/gradio_api/component_server`, the `tick` event with the page's
inputs when the data channel says `send_input`, the page-update relay (`state_change`) when it
says `fetch_output`, and the stats timer at the page's own interval, all read back over the session's SSE stream.
Once every caller is live it measures, for `--seconds`:

- the CPU of the app's whole process tree (utime + stime from /proc, children included), in
  cores and per caller, and of its busiest thread: with one torch thread, the pool's ticker,
  which runs the whole engine step. The rest ("rest per caller") is what a caller costs outside
  the model: WebRTC, Opus, resampling, page events, and the IPC when there are media workers;
- the CPU of this benchmark's own callers (its process), which share the machine with the app;
- the pool's tick and latency percentiles (`/api/status`);
- per caller, the agent audio received per wall second and the longest gap between frames;
- the page updates (SSE `process_generating` messages) per caller per second.

`--waiting W ...` adds W callers after the live ones, who wait in the queue (`--max-queue W`) while
the window is measured: what a caller costs the server while it waits, against the same live
callers alone (W = 0) in the same run.

`--engine-only` runs the same slots without any WebRTC: the pool is fed frames in process by
as many in-process callers, so `app tree - engine only` is what the media path costs per caller
as long as the app keeps up; once one process is saturated (one core of GIL), the thread split
is the measure that still holds.

    python bench/media.py --callers 1 2 4 8 --slots 8 --seconds 20 [--write]
    python bench/media.py --callers 2 --slots 2 --waiting 0 8 --compare DIR     (what a waiting caller costs)
    python bench/media.py --callers 4 --slots 4 --ray-nodes 2 --app-args '--media-workers 2' \
        --app-args '--engines ray --slots 2'     (two tiny engines as Ray actors, beside media workers)
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    REPO,
    command_line,
    free_port,
    get_json,
    machine,
    machine_line,
    md_table,
    replace_section,
)
from tests.callers import follow_mic_hold  # noqa: E402

log = logging.getLogger("bench.media")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PERSONA = "You enjoy having a good conversation."


# ---- the app's process tree ---------------------------------------------------------------------


@dataclass(frozen=True)
class TreeCpu:
    """One reading of `pid` and its descendants: utime + stime in seconds, of the whole tree
    (exited threads included, from each process's /proc/PID/stat) and of each live thread."""

    total: float
    threads: dict[tuple[int, int], float]  # by (pid, tid)

    @classmethod
    def read(cls, pid: int) -> TreeCpu:
        total, threads, todo = 0.0, {}, [pid]
        while todo:
            p = todo.pop()
            try:
                total += _cpu_seconds(Path(f"/proc/{p}/stat"))
                for task in Path(f"/proc/{p}/task").iterdir():
                    threads[(p, int(task.name))] = _cpu_seconds(task / "stat")
                    todo.extend(int(c) for c in (task / "children").read_text().split())
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
        return cls(total, threads)


def _cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def busiest_thread(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> float:
    """CPU seconds of the thread that used the most between two `TreeCpu` readings: with one
    torch thread, the pool's ticker, which runs the whole engine step."""
    return max((after[k] - before.get(k, 0.0) for k in after), default=0.0)


class App:
    """`python app.py --model tiny` in a subprocess, as a user starts it (plus loopback ICE)."""

    def __init__(self, slots: int, extra: list[str], cache_dir: str | None, repo: Path = REPO,
                 ray_nodes: int = 0, threads: int | None = 1) -> None:
        self.port = free_port()
        self.cluster = None  # with --engines ray and ray_nodes: a cluster of that many nodes, CPU counted
        if ray_nodes and "ray" in extra:
            self.cluster = subprocess.Popen([sys.executable, "bench/ray_cluster.py", str(ray_nodes)], cwd=REPO,
                                            stdout=subprocess.PIPE, text=True)
            extra = [*extra, "--ray-address", self.cluster.stdout.readline().strip()]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="media-bench-app-", suffix=".log", delete=False)
        env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PERSONAPLEX_LOOPBACK_ICE="1")
        if threads is not None:  # one torch thread: the busiest thread is then the whole engine step
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env.pop("HF_TOKEN", None)
        # Every caller seated (admission by slot count): this measures what N callers cost, however
        # many the host keeps in real time; `extra` may say otherwise (bench/admission.py does).
        cmd = [sys.executable, "app.py", "--model", "tiny", "--slots", str(slots), "--port", str(self.port),
               "--max-queue", "0", "--admission", "slots", *extra]
        if cache_dir:
            cmd += ["--cache-dir", cache_dir]
        self.proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                get_json(self.base + "/api/status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the app did not start:\n{Path(self.log.name).read_text()[-3000:]}") from None
                time.sleep(0.5)

    def status(self) -> dict:
        return get_json(self.base + "/api/status")

    def cpu(self) -> TreeCpu:
        app = TreeCpu.read(self.proc.pid)
        if self.cluster is None:
            return app
        ray = TreeCpu.read(self.cluster.pid)
        return TreeCpu(app.total + ray.total, {**app.threads, **ray.threads})

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.cluster is not None:
            self.cluster.terminate()
            self.cluster.wait(30)
        os.unlink(self.log.name)


# ---- one caller, as the page drives the app -------------------------------------------------------


@dataclass
class PageEvents:
    """The fn_index of each page event a caller raises, read from the page's `/config`."""

    webrtc: int  # component id of the WebRTC component
    tick: int
    state_change: int
    start_recording: int
    stop_recording: int
    timer: int | None
    timer_seconds: float  # the page's gr.Timer interval: how often each open page raises the timer event

    @classmethod
    def from_config(cls, config: dict) -> PageEvents:
        comp = next(c["id"] for c in config["components"] if c.get("type") == "webrtc")
        timer_component = next((c for c in config["components"] if c.get("type") == "timer"), None)
        timer = timer_component["id"] if timer_component else None
        timer_seconds = float(timer_component["props"]["value"]) if timer_component else 0.0
        found: dict[str, int] = {}
        for index, dep in enumerate(config["dependencies"]):
            for target, event in dep["targets"]:
                if target == comp and event in ("tick", "state_change", "start_recording", "stop_recording"):
                    found.setdefault(event, index)
                if timer is not None and target == timer and event == "tick":
                    found.setdefault("timer", index)
        return cls(comp, found["tick"], found["state_change"], found["start_recording"], found["stop_recording"],
                   found.get("timer"), timer_seconds)


@dataclass
class CallerResult:
    live: bool = False
    audio_s: float = 0.0  # agent audio received inside the window
    longest_gap_s: float = 0.0
    page_updates: int = 0  # SSE process_generating messages inside the window
    last_transcript: str = ""
    errors: list[str] = field(default_factory=list)


class PageCaller:
    """One browser page: a Gradio session and an aiortc peer connection."""

    def __init__(self, http, base: str, events: PageEvents, index: int) -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.http, self.base, self.events, self.index = http, base, events, index
        self.session = secrets.token_hex(6)
        self.webrtc_id = secrets.token_hex(6)
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.result = CallerResult()
        self.window: tuple[float, float] | None = None  # (start, end) of the measured window
        self.last_frame: float | None = None
        self.relay_running = False
        self.pending: set[str] = set()
        self.stream_task: asyncio.Task | None = None
        self.tasks: list[asyncio.Task] = []
        self.args = ["NATF2", PERSONA, 0.7, 25, 0.8, 250, 1000 + index]
        self.held_mic = None  # the microphone, while the call waits

    def in_window(self, t: float) -> bool:
        return self.window is not None and self.window[0] <= t < self.window[1]

    # Gradio's queue protocol, as the page's JS client speaks it.
    async def join(self, fn_index: int, data: list) -> str | None:
        body = {"data": data, "event_data": None, "fn_index": fn_index, "trigger_id": None,
                "session_hash": self.session}
        async with self.http.post(f"{self.base}/gradio_api/queue/join", json=body) as r:
            if r.status != 200:
                self.result.errors.append(f"join {fn_index}: HTTP {r.status}")
                return None
            event_id = (await r.json())["event_id"]
        self.pending.add(event_id)
        if self.stream_task is None or self.stream_task.done():
            self.stream_task = asyncio.ensure_future(self.read_stream())
        return event_id

    async def read_stream(self) -> None:
        async with self.http.get(f"{self.base}/gradio_api/queue/data", params={"session_hash": self.session},
                                 timeout=None) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                self.seen(msg)
                kind = msg.get("msg")
                if kind == "process_generating":
                    if self.in_window(time.monotonic()):
                        self.result.page_updates += 1
                elif kind == "process_completed":
                    self.pending.discard(msg.get("event_id"))
                    if msg.get("event_id") == getattr(self, "relay_event", None):
                        self.relay_running = False
                elif kind == "close_stream":
                    return

    def seen(self, msg: dict) -> None:
        """Every message of the session's event stream, as it arrives (for a subclass to read)."""

    async def component(self, fn_name: str, data) -> dict:
        body = {"session_hash": self.session, "component_id": self.events.webrtc, "fn_name": fn_name, "data": data}
        async with self.http.post(f"{self.base}/gradio_api/component_server/", json=body) as r:
            return await r.json()

    async def on_message(self, message: str) -> None:
        kind = json.loads(message).get("type")
        self.held_mic = follow_mic_hold(message, self.pc, self.held_mic)  # no audio while the call waits
        if kind == "send_input":
            await self.join(self.events.tick, [self.webrtc_id, *self.args])
        elif kind == "fetch_output" and not self.relay_running:
            self.relay_running = True
            self.relay_event = await self.join(self.events.state_change, [self.webrtc_id])

    async def timer(self) -> None:
        while True:
            if self.events.timer is None:
                return
            await asyncio.sleep(self.events.timer_seconds)
            await self.join(self.events.timer, [])

    async def start(self) -> None:
        from aiortc import RTCSessionDescription

        await self.join(self.events.start_recording, [])
        await self.component("turn", {})
        channel = self.pc.createDataChannel("text")
        channel.on("message", lambda m: self.tasks.append(asyncio.ensure_future(self.on_message(m))))
        self.pc.on("track", lambda track: self.tasks.append(asyncio.ensure_future(self.drain(track))))
        self.pc.addTrack(SpeechLikeTrack(self.index))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await self.component("offer", {"sdp": self.pc.localDescription.sdp, "type": "offer",
                                                "webrtc_id": self.webrtc_id})
        if "sdp" not in answer:
            raise RuntimeError(f"offer refused: {answer}")
        if "a=ptime:40" in answer["sdp"]:
            from personaplex_demo.rtc.patches import install_packet_encoder

            install_packet_encoder()  # as a browser does: it sends the packet length the answer asks for
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        self.tasks.append(asyncio.ensure_future(self.timer()))

    async def drain(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except Exception:
                return
            now = time.monotonic()
            self.result.live = True
            if self.in_window(now):
                if self.last_frame is not None and self.in_window(self.last_frame):
                    self.result.longest_gap_s = max(self.result.longest_gap_s, now - self.last_frame)
                self.result.audio_s += frame.samples / frame.sample_rate
            self.last_frame = now

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await self.join(self.events.stop_recording, [""])
        await self.pc.close()
        if self.stream_task is not None:
            self.stream_task.cancel()


def make_track_class():
    from aiortc.mediastreams import MediaStreamTrack
    from av import AudioFrame

    from tests.callers import catch_up

    class _SpeechLikeTrack(MediaStreamTrack):
        """A 48 kHz microphone in real time: a tone that comes and goes, 20 ms per frame."""

        kind = "audio"

        def __init__(self, index: int) -> None:
            super().__init__()
            self.freq, self.n, self.t0 = 180.0 + 20 * index, 0, None

        async def recv(self) -> AudioFrame:
            if self.t0 is None:
                self.t0 = time.monotonic()
            catch_up(self)  # a microphone nobody read for a while (held): no backlog
            await asyncio.sleep(max(0.0, self.t0 + self.n * 0.02 - time.monotonic()))
            t = (np.arange(960) + self.n * 960) / 48000
            gate = 1.0 if (self.n // 50) % 3 else 0.0  # talk two seconds, pause one
            pcm = (gate * 0.2 * 32767 * np.sin(2 * np.pi * self.freq * t)).astype(np.int16)
            frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
            self.n += 1
            return frame

    return _SpeechLikeTrack


SpeechLikeTrack = None  # set in main(): aiortc/av are imported only when the benchmark runs


# ---- one run -------------------------------------------------------------------------------------


@dataclass
class Row:
    mode: str
    callers: int
    cores: float
    per_caller: float
    tick_p50: float
    tick_p99: float
    lat_p50: float
    lat_p99: float
    audio_min: float
    audio_max: float
    gap_max_ms: float
    updates_per_s: float
    live: int
    ticker: float = float("nan")  # cores of the busiest thread: the engine's ticker
    load_generator: float = float("nan")  # cores this benchmark's own callers used, on the same machine
    waiting: int = 0  # callers waiting in the queue during the window (not counted in `callers`)

    @property
    def rest_per_caller(self) -> float:
        """Everything but the engine's ticker thread, per caller: media, page events, IPC."""
        return (self.cores - self.ticker) / self.callers


async def with_loopback(run):
    """Await `run` (callers' coroutine) with aiortc set up as the callers need it on this machine."""
    import aioice.ice
    import aiortc.rtcrtpsender

    from personaplex_demo.rtc.patches import install_audio_level, loopback_host_addresses

    aioice.ice.get_host_addresses = loopback_host_addresses
    install_audio_level()  # a browser computes the RTP audio level natively, not in a Python loop
    encoder_factory = aiortc.rtcrtpsender.get_encoder  # a caller may switch it (a=ptime); each run starts anew
    try:
        return await run
    finally:
        aiortc.rtcrtpsender.get_encoder = encoder_factory


async def run_webrtc(app: App, n: int, seconds: float, settle: float, waiting: int = 0) -> Row:
    return await with_loopback(_run_webrtc(app, n, seconds, settle, waiting))


async def _run_webrtc(app: App, n: int, seconds: float, settle: float, waiting: int = 0) -> Row:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(app.base + "/config") as r:
            events = PageEvents.from_config(await r.json())
        callers = [PageCaller(http, app.base, events, i) for i in range(n)]
        for c in callers:
            await c.start()
            await asyncio.sleep(0.3)  # callers arrive one after another, as people do
        deadline = time.monotonic() + 60
        while app.status()["slots_live"] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {app.status()['slots_live']} of {n} calls went live")
            await asyncio.sleep(0.5)
        queued = [PageCaller(http, app.base, events, n + i) for i in range(waiting)]
        for c in queued:
            await c.start()
            await asyncio.sleep(0.3)
        while app.status()["queue_length"] < waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {app.status()['queue_length']} of {waiting} callers waiting")
            await asyncio.sleep(0.5)
        await asyncio.sleep(settle)
        t0, cpu0, own0 = time.monotonic(), app.cpu(), time.process_time()
        for c in callers:
            c.window = (t0, t0 + seconds)
        await asyncio.sleep(seconds)
        cpu1, t1, own1 = app.cpu(), time.monotonic(), time.process_time()
        status = app.status()
        if status["queue_length"] != waiting or status["slots_live"] != n:
            raise RuntimeError(f"{status['slots_live']} live and {status['queue_length']} waiting at the end of the "
                               f"window, not {n} and {waiting}")
        for c in callers + queued:
            await c.stop()
    cores = (cpu1.total - cpu0.total) / (t1 - t0)
    audio = [c.result.audio_s / seconds for c in callers]
    return Row("app (WebRTC)", n, cores, cores / n, status["tick_p50_ms"], status["tick_p99_ms"],
               status["latency_p50_ms"], status["latency_p99_ms"], min(audio), max(audio),
               1e3 * max(c.result.longest_gap_s for c in callers),
               sum(c.result.page_updates for c in callers) / n / seconds, status["slots_live"],
               busiest_thread(cpu0.threads, cpu1.threads) / (t1 - t0), (own1 - own0) / (t1 - t0))


def run_engine_only(n: int, slots: int, seconds: float, settle: float, cache_dir: str | None) -> Row:
    """The same slots, fed in process: what the engine and the pool cost without any WebRTC."""
    import torch

    torch.set_num_threads(1)
    from personaplex_demo.engine.pcm import SamplingParams
    from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
    from personaplex_demo.serving.config import PoolConfig
    from personaplex_demo.serving.pool import SlotPool

    runtime = build_runtime(RuntimeOptions(model="tiny", slots=slots,
                                           cache_dir=Path(cache_dir) if cache_dir else None))
    pool = SlotPool(runtime.engine, PoolConfig(time_limit_seconds=None, admission="slots"))
    pool.start()

    async def feed(call, stop_at: float) -> None:
        await call.wait_live(timeout=30)
        frame = np.zeros(1920, np.float32)
        t, k = time.monotonic(), 0
        while time.monotonic() < stop_at:
            k += 1
            call.push_audio(frame)
            while (out := await call.next_output(0.0)) is not None:
                del out
            await asyncio.sleep(max(0.0, t + k * 0.08 - time.monotonic()))

    async def everyone():
        calls = [pool.admit("NATF2", PERSONA, SamplingParams(seed=1000 + i)) for i in range(n)]
        stop_at = time.monotonic() + settle + seconds + 2
        tasks = [asyncio.ensure_future(feed(c, stop_at)) for c in calls]
        await asyncio.sleep(settle)
        t0, c0, threads0 = time.monotonic(), time.process_time(), TreeCpu.read(os.getpid()).threads
        await asyncio.sleep(seconds)
        wall = time.monotonic() - t0
        used = (time.process_time() - c0) / wall
        ticker = busiest_thread(threads0, TreeCpu.read(os.getpid()).threads) / wall
        await asyncio.gather(*tasks)
        for c in calls:
            c.release()
        return used, ticker

    try:
        cores, ticker = asyncio.run(everyone())
        m = pool.snapshot()
    finally:
        pool.shutdown()
    return Row("engine only", n, cores, cores / n, m.tick_p50_ms, m.tick_p99_ms, m.latency_p50_ms, m.latency_p99_ms,
               float("nan"), float("nan"), float("nan"), float("nan"), m.slots_live, ticker)


# ---- the report ----------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    def f(x: float, spec: str = ".2f") -> str:
        return "-" if x != x else format(x, spec)

    return md_table(
        ["mode", "callers", "CPU (cores)", "per caller", "engine thread (cores)", "rest per caller",
         "tick p50/p99 (ms)", "latency p50/p99 (ms)", "audio received (s/s)", "longest gap (ms)",
         "page updates /s", "callers' own CPU"],
        [[r.mode, r.callers, f(r.cores), f(r.per_caller, ".3f"), f(r.ticker), f(r.rest_per_caller, ".3f"),
          f"{f(r.tick_p50, '.0f')}/{f(r.tick_p99, '.0f')}", f"{f(r.lat_p50, '.0f')}/{f(r.lat_p99, '.0f')}",
          "-" if r.audio_min != r.audio_min else f"{r.audio_min:.2f}-{r.audio_max:.2f}", f(r.gap_max_ms, ".0f"),
          f(r.updates_per_s, ".1f"), f(r.load_generator)] for r in rows])


def media_cost(rows: list[Row]) -> str:
    """The app tree minus the engine-only run of the same caller count (valid only while the app
    keeps up; the table's "rest per caller" is the thread split of the same run), and which runs
    did not keep up."""
    engine = {r.callers: r.cores for r in rows if r.mode == "engine only"}
    lines = []
    for r in rows:
        if r.mode == "engine only":
            continue
        notes = []
        if r.callers in engine:
            notes.append(f"app - engine only = ({r.cores:.2f} - {engine[r.callers]:.2f}) / {r.callers} = "
                         f"{(r.cores - engine[r.callers]) / r.callers:.3f} core per caller")
        if r.audio_min < 0.98:
            notes.append(f"not keeping up ({r.audio_min:.2f} s of audio per second): its figures are what it got, "
                         "not what it needed")
        if notes:
            lines.append(f"- {r.mode}, {r.callers} callers: " + "; ".join(notes))
    return "\n".join(lines)


def waiting_cost(rows: list[Row]) -> str:
    """Each run with callers waiting against the same mode's run without: the server's CPU per
    waiting caller, beside what the media of a live caller costs (everything but the engine's
    ticker, per live caller, in the run without)."""
    alone = {(r.mode, r.callers): r for r in rows if not r.waiting}
    lines = []
    for r in rows:
        base = alone.get((r.mode.rsplit(f", {r.waiting} waiting", 1)[0], r.callers)) if r.waiting else None
        if base is None:
            continue
        per_waiting = (r.cores - base.cores) / r.waiting
        lines.append(f"- {r.mode}: ({r.cores:.3f} - {base.cores:.3f}) / {r.waiting} = {per_waiting:.4f} core per "
                     f"waiting caller, against {base.rest_per_caller:.3f} core of media per live caller "
                     f"({per_waiting / base.rest_per_caller:.2f} of it)")
    return ("\n\nWhat a waiting caller costs:\n" + "\n".join(lines)) if lines else ""


def main() -> None:
    global SpeechLikeTrack
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window, once every caller is live")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the last caller is live, unmeasured")
    ap.add_argument("--app-args", action="append", default=None,
                    help="extra flags for app.py, e.g. '--media-workers 2'; given several times, each is a mode, "
                         "run in turn at every caller count")
    ap.add_argument("--ray-nodes", type=int, default=0,
                    help="for a mode with --engines ray: a Ray cluster of this many nodes on this machine, one tiny "
                         "engine each (bench/ray_cluster.py), its CPU counted with the app's")
    ap.add_argument("--label", default=None, help="the mode's name in the table (default: from --app-args)")
    ap.add_argument("--engine-only", action="store_true", help="also run the engine-only baseline")
    ap.add_argument("--waiting", type=int, nargs="+", default=[0],
                    help="callers who wait in the queue beside the live ones, each count a run (default: none)")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="also run app.py from another checkout (e.g. a git worktree of an older commit), "
                         "alternating with this one at each caller count")
    ap.add_argument("--cache-dir", default=None, help="where the tiny model is built (app.py --cache-dir)")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    ap.add_argument("--section", default="Callers per host (media path)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    SpeechLikeTrack = make_track_class()
    rows: list[Row] = []
    modes = a.app_args or [""]
    apps = [(a.label or ("app " + m if m else "app (default topology)"), REPO, m) for m in modes]
    if a.compare:
        other = Path(a.compare).resolve()
        commit = subprocess.run(["git", "-C", str(other), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or other.name
        # Each mode at the other checkout, then here.
        apps = [app for name, repo, m in apps for app in ((f"{name}, at {commit}", other, m), (name, repo, m))]
    for n in a.callers:
        for name, repo, mode in apps:
            for waiting in a.waiting:
                extra = mode.split() + (["--max-queue", str(waiting)] if waiting else [])
                app = App(a.slots, extra, a.cache_dir, repo, a.ray_nodes)
                try:
                    row = asyncio.run(run_webrtc(app, n, a.seconds, a.settle, waiting))
                finally:
                    app.close()
                row.mode = name + (f", {waiting} waiting" if waiting else "")
                row.waiting = waiting
                rows.append(row)
                log.info("%s", table([row]))
        if a.engine_only:
            # Its own process, so the engine run starts as cold as the app's did.
            out = subprocess.run([sys.executable, __file__, "--engine-only-run", str(n), str(a.slots), str(a.seconds),
                                  str(a.settle), a.cache_dir or ""], capture_output=True, text=True, cwd=REPO,
                                 env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:])
            rows.append(Row(**json.loads(out.stdout.strip().splitlines()[-1])))
            log.info("%s", table(rows[-1:]))
    body = table(rows) + "\n\n" + media_cost(rows) + waiting_cost(rows)
    print(body)
    if a.write:
        replace_section(a.section, body, command=command_line(), info=machine())
        log.info("wrote BENCHMARKS.md § %s (%s)", a.section, machine_line(machine()))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-only-run":
        n, slots, seconds, settle, cache = sys.argv[2:7]
        logging.basicConfig(level=logging.WARNING)
        r = run_engine_only(int(n), int(slots), float(seconds), float(settle), cache or None)
        print(json.dumps(r.__dict__))
    else:
        main()
