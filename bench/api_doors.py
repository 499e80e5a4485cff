"""What an API caller costs each of the app's processes: raw clients of each socket door against
the app as a user starts it (default topology, tiny model, one torch thread), in real time.

For each door (`realtime`: OpenAI Realtime events over plain `websockets`; `live`: GPT-Live;
`chat`: NVIDIA's /api/chat with Ogg Opus through sphn; `twilio`: the phone door, a signed webhook
and Media Streams' mu-law events every 20 ms, tests/phone_network.py) and each caller count N, this starts the
app, connects N clients that configure a voice and a persona and stream 24 kHz speech-like audio
at the pace it plays (40 ms appends, 80 ms Opus pages on /api/chat), waits until every caller
hears the agent, and measures over `--seconds`:

- the CPU of the main process (all its threads), of the media workers (by their pids in
  /api/status) and of the engine process, in cores; "main per caller" is the slope between the smallest and the largest N;
- per caller, the agent audio received per wall second (1.00 is real time).

`--compare DIR` runs the same against a checkout of another version in DIR (for example the
previous main: `git worktree add /tmp/prev HEAD~1`), alternating app by app in one run.

    python bench/api_doors.py --doors realtime live chat --callers 1 4 --seconds 15 [--compare DIR] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command_line, machine, machine_line, md_table, replace_section  # noqa: E402
from bench.media import App, _cpu_seconds  # noqa: E402

log = logging.getLogger("bench.api_doors")
PERSONA = "You enjoy having a good conversation."
RATE = 24000


def voice_like(seconds: float, seed: int) -> np.ndarray:
    """A caller's microphone: a gliding tone in syllable-length bursts (the doors' work does not
    depend on the words)."""
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t + seed)
    envelope = (np.sin(2 * np.pi * 3 * t + seed) > -0.3).astype(np.float32)
    return (8000 * envelope * np.sin(2 * np.pi * np.cumsum(pitch) / RATE)).astype(np.int16)


class Caller:
    """One raw client of one door: configures a call, streams in real time, counts agent audio."""

    def __init__(self, door: str, base: str, index: int) -> None:
        self.door, self.base, self.index = door, base.replace("http", "ws", 1), index
        self.arrivals: list[tuple[float, int]] = []  # (time, samples) of agent audio
        self.ws = None

    async def run(self, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect

        url = {"realtime": "/v1/realtime", "live": "/v1/live/sessions",
               "chat": f"/api/chat?voice_prompt=NATF2.pt&text_prompt={PERSONA.replace(' ', '%20')}"}[self.door]
        async with connect(self.base + url, max_size=None) as ws:
            self.ws = ws
            await self.configure(ws)
            reader = asyncio.create_task(self.read(ws))
            try:
                await self.stream(ws, voice_like(600.0, self.index), stop)
            finally:
                reader.cancel()

    async def configure(self, ws) -> None:
        if self.door == "realtime":
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "instructions": PERSONA, "audio": {"output": {"voice": "NATF2"}}}}))
        elif self.door == "live":
            await ws.send(json.dumps({"type": "session.start", "session": {
                "instructions": PERSONA, "audio": {"output": {"voice": "NATF2"}}}}))

    async def read(self, ws) -> None:
        import sphn

        opus = sphn.OpusStreamReader(RATE)
        async for message in ws:
            now = time.monotonic()
            if self.door == "chat":
                if message[:1] == b"\x01":
                    self.arrivals.append((now, opus.append_bytes(message[1:]).size))
                continue
            event = json.loads(message)
            if event["type"] in ("response.output_audio.delta", "session.output_audio.delta"):
                self.arrivals.append((now, len(base64.b64decode(event["delta"])) // 2))

    async def stream(self, ws, samples: np.ndarray, stop: asyncio.Event) -> None:
        import sphn

        chunk = 1920 if self.door == "chat" else 960
        writer = sphn.OpusStreamWriter(RATE) if self.door == "chat" else None
        kind = "input_audio_buffer.append" if self.door == "realtime" else "session.input_audio.append"
        start = time.monotonic()
        for i in range(0, samples.size - chunk, chunk):
            if stop.is_set():
                return
            piece = samples[i:i + chunk]
            if writer is not None:
                page = writer.append_pcm(piece.astype(np.float32) / 32768.0)
                if page:
                    await ws.send(b"\x01" + page)
            else:
                await ws.send(json.dumps({"type": kind, "audio": base64.b64encode(piece.astype("<i2").tobytes()).decode()}))
            await asyncio.sleep(max(0.0, start + (i + chunk) / RATE - time.monotonic()))

    def heard(self, since: float, until: float) -> float:
        return sum(n for at, n in self.arrivals if since <= at <= until) / RATE


PHONE_TOKEN = "bench-auth-token"


class PhoneCaller:
    """A phone call as Twilio places it: the signed webhook, then the stream in real time."""

    def __init__(self, base: str, index: int) -> None:
        self.base, self.index = base, index
        self.stream = None

    @property
    def arrivals(self) -> list[tuple[float, int]]:
        return self.stream.arrivals if self.stream is not None else []

    async def run(self, stop: asyncio.Event) -> None:
        import httpx

        from tests.phone_network import PhoneStream, caller_voice, place_call

        async with httpx.AsyncClient(timeout=10) as http:
            twiml = await place_call(http, f"{self.base}/telephony/twilio?voice=NATF2", PHONE_TOKEN)
        self.stream = PhoneStream(twiml)
        await self.stream.open()
        talking = asyncio.create_task(self.stream.talk(caller_voice(3.0, self.index), 600))
        try:
            await stop.wait()
        finally:
            talking.cancel()
            await self.stream.hang_up()

    def heard(self, since: float, until: float) -> float:
        """Seconds of agent audio (8000 mu-law bytes a second) that arrived in [since, until]."""
        marks = [(0.0, 0), *self.arrivals]
        return sum(n - before for (_, before), (at, n) in zip(marks, marks[1:]) if since <= at <= until) / 8000


def process_cpu(app: App, workers: list[int]) -> dict[str, float]:
    """CPU seconds of the main process, of the media workers (`workers`: their pids, from
    /api/status) and of every other child (the engine process)."""
    seconds = {"main": _cpu_seconds(Path(f"/proc/{app.proc.pid}/stat")), "media": 0.0, "engine": 0.0}
    for child in _descendants(app.proc.pid):
        try:
            cpu = _cpu_seconds(Path(f"/proc/{child}/stat"))
        except (FileNotFoundError, ProcessLookupError):
            continue
        seconds["media" if child in workers else "engine"] += cpu
    return seconds


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                found += kids
                todo += kids
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


@dataclass
class Row:
    version: str
    door: str
    callers: int
    main: float
    media: float
    engine: float
    audio: list[float]


async def measure(app: App, door: str, n: int, seconds: float, settle: float) -> tuple[dict[str, float], list[float]]:
    stop = asyncio.Event()
    callers = [PhoneCaller(app.base, i) if door == "twilio" else Caller(door, app.base, i) for i in range(n)]
    tasks = [asyncio.create_task(c.run(stop)) for c in callers]
    deadline = time.monotonic() + 60
    while not all(c.arrivals for c in callers):
        if time.monotonic() > deadline or any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()
            raise RuntimeError(f"{door}: not every caller heard the agent within 60 s")
        await asyncio.sleep(0.1)
    await asyncio.sleep(settle)
    workers = [w["pid"] for w in app.status().get("media_workers", [])]
    t0, cpu0 = time.monotonic(), process_cpu(app, workers)
    await asyncio.sleep(seconds)
    t1, cpu1 = time.monotonic(), process_cpu(app, workers)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cores = {k: (cpu1[k] - cpu0[k]) / (t1 - t0) for k in cpu0}
    return cores, [c.heard(t0, t1) / (t1 - t0) for c in callers]


def per_caller(rows: list[Row], version: str, door: str, what: str) -> float:
    mine = sorted((r for r in rows if r.version == version and r.door == door), key=lambda r: r.callers)
    if len(mine) < 2 or mine[-1].callers == mine[0].callers:
        return float("nan")
    return (getattr(mine[-1], what) - getattr(mine[0], what)) / (mine[-1].callers - mine[0].callers)


def table(rows: list[Row]) -> str:
    body = [[r.version, r.door, r.callers, f"{r.main:.3f}", f"{r.media:.3f}", f"{r.engine:.2f}",
             f"{min(r.audio):.2f}-{max(r.audio):.2f}"] for r in rows]
    detail = md_table(["version", "door", "callers", "main (cores)", "media workers (cores)", "engine (cores)",
                       "agent audio s/s per caller"], body)
    slopes = []
    for version in dict.fromkeys(r.version for r in rows):
        for door in dict.fromkeys(r.door for r in rows):
            slopes.append([version, door, f"{per_caller(rows, version, door, 'main'):.4f}",
                           f"{per_caller(rows, version, door, 'media'):.4f}"])
    return detail + "\n\n" + md_table(["version", "door", "main per caller (cores)", "media workers per caller"],
                                      slopes)


async def run(args) -> list[Row]:
    versions = [("this", REPO)] + ([("compared", Path(args.compare))] if args.compare else [])
    rows = []
    for door in args.doors:
        for n in args.callers:
            for version, repo in versions:
                app = App(args.slots, args.app_args, args.cache_dir, repo=repo)
                try:
                    cores, audio = await measure(app, door, n, args.seconds, args.settle)
                finally:
                    app.close()
                row = Row(version, door, n, cores["main"], cores["media"], cores["engine"], audio)
                log.info("%s %s x%d: main %.3f, media %.3f, engine %.2f cores; audio %s", version, door, n,
                         row.main, row.media, row.engine, ", ".join(f"{a:.2f}" for a in audio))
                rows.append(row)
    return rows


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doors", nargs="+", default=["realtime", "live", "chat", "twilio"],
                    choices=["realtime", "live", "chat", "twilio"])
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--app-args", nargs="*", default=[], help="more app.py flags (default: the default topology)")
    ap.add_argument("--compare", default=None, metavar="DIR", help="a checkout of another version, run alternately")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--section", default="API callers per process", help="the section of BENCHMARKS.md to write")
    args = ap.parse_args()
    os.environ["TWILIO_AUTH_TOKEN"] = PHONE_TOKEN  # the phone door, in every app this starts
    rows = asyncio.run(run(args))
    text = table(rows)
    print(machine_line(machine()))
    print(text)
    if args.write:
        replace_section(args.section, text, command_line(), machine())


if __name__ == "__main__":
    main()
