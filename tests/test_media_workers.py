"""Several processes: media workers, and several engines, with the app launched as a user starts it.

Callers are aiortc peers that drive the page's own endpoints (see `callers.PageCaller`): the
offer through Gradio's component server, the inputs through the `tick` event, the transcript and
status through the page's relay on `state_change`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from personaplex_demo.orchestration.topology import default_media_workers, ipc_directory, resolve_devices
from personaplex_demo.web import mic_hold

from .browser_support import LaunchedApp, launched_app
from .callers import PageCaller, PageConfig, until
from .sdk_callers import LiveClient, SdkCaller

pytestmark = pytest.mark.usefixtures("loopback_ice")

PERSONAS = ["You enjoy having a good conversation.", "You are a wise and friendly teacher.",
            "You work for a bank and answer questions about accounts.", "You are an astronaut on Mars."]
VOICES = ["NATF2", "VARM1", "NATM0", "VARF3"]


def udp_ports_of(pid: int) -> set[int]:
    """The local UDP ports of process `pid`'s sockets (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def answer_ports(caller: PageCaller) -> set[int]:
    """The server's ICE candidate ports in the answer a caller got: where its media goes."""
    return {int(line.split()[5]) for line in caller.pc.remoteDescription.sdp.splitlines()
            if line.startswith("a=candidate:")}


def is_live(caller: PageCaller) -> bool:
    return caller.status.startswith("Live") and bool(caller.transcript) and caller.samples > 24000


async def call_all(http: httpx.AsyncClient, count: int, first: int = 0) -> list[PageCaller]:
    page = await PageConfig.fetch(http)
    callers = [PageCaller(http, page, VOICES[i % 4], PERSONAS[i % 4], seed=i) for i in range(first, first + count)]
    for i, caller in enumerate(callers):
        answer = await caller.offer(200.0 + 70 * i)
        assert "a=ptime:40" in answer["sdp"], answer  # answered as the page's own component answers
    for caller in callers:
        await caller.wait_connected()
    return callers


@pytest.fixture(scope="module")
def app_with_workers(tiny_cache_dir, tmp_path_factory) -> LaunchedApp:
    # Admission by slot count: this follows calls across worker processes on any host; admission
    # by headroom, which depends on the host's speed, has tests of its own (test_headroom.py).
    args = ["--slots", "4", "--media-workers", "2", "--admission", "slots"]
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=args) as app:
        yield app


async def test_a_realtime_socket_and_a_page_caller_share_the_room_across_processes(app_with_workers):
    """The Realtime socket is admitted by the main process and served by a media worker, beside
    the page's call in a media worker: one room, one set of slots."""
    app = app_with_workers
    await until(lambda: sum(w["alive"] for w in app.status()["media_workers"]) == 2, 90, "both workers")
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http, SdkCaller(app.base_url, None) as sdk:
        (page,) = await call_all(http, 1, first=2)
        await sdk.configure("VARF4", "You are a wise and friendly teacher.", seed=9)
        await sdk.wait_live()
        streaming = asyncio.create_task(sdk.stream(np.zeros(6 * 24000, np.int16)))
        await until(lambda: is_live(page), 30, "the page caller live")
        await until(lambda: app.status()["calls_by_door"] == {"realtime": 1, "page": 1}, 3, "both doors counted")
        assert sum(w["api_sockets"] for w in app.status()["media_workers"]) == 1
        await until(lambda: len(sdk.transcript) > 5 and sdk.audio_seconds(sdk.live_at) > 1.0, 10, "the agent's words")
        assert sdk.transcript != page.transcript and not sdk.errors
        # Hanging up either frees its slot within 3 s.
        await sdk.conn.close()
        streaming.cancel()
        await until(lambda: app.status()["calls_by_door"] == {"page": 1}, 3, "the socket's slot")
        await page.hang_up()
        await until(lambda: app.status()["slots_free"] == 4, 3, "the page caller's slot")


async def test_a_killed_worker_closes_its_api_sockets_and_gives_their_places_back(app_with_workers):
    """A socket served by a worker dies with it: the client sees the connection end, and the
    door's counts (open sockets, the client's socket limit) let it go at once."""
    app = app_with_workers
    await until(lambda: sum(w["alive"] for w in app.status()["media_workers"]) == 2, 90, "both workers")
    url = app.base_url.replace("http", "ws", 1) + "/v1/realtime"
    async with ws_connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        status = app.status()
        (victim,) = [w["pid"] for w in status["media_workers"] if w["api_sockets"] == 1]
        assert status["realtime"]["sockets_open"] == 1
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    await until(lambda: app.status()["realtime"]["sockets_open"] == 0, 5, "the socket counted closed")
    await until(lambda: sum(w["alive"] for w in app.status()["media_workers"]) == 2, 90, "a replacement")
    # The client's places are all free again (the limit is 4): four sockets open at once.
    async with contextlib.AsyncExitStack() as stack:
        sockets = [await stack.enter_async_context(ws_connect(url)) for _ in range(4)]
        for ws in sockets:
            assert json.loads(await ws.recv())["type"] == "session.created"
        assert sum(w["api_sockets"] for w in app.status()["media_workers"]) == 4


async def test_without_media_workers_the_main_process_serves_the_api_sockets(tiny_cache_dir, tmp_path):
    with launched_app(tmp_path, tiny_cache_dir, args=["--slots", "1", "--media-workers", "0"]) as app:
        async with SdkCaller(app.base_url, None) as sdk:
            await sdk.configure("NATF1", "You are a calm radio host.")
            await sdk.wait_live()
            await until(lambda: app.status()["realtime"]["sockets_open"] == 1, 3, "the socket counted")
            assert app.status()["media_workers"] == []
            await sdk.stream(np.zeros(24000, np.int16))
            await until(lambda: sdk.audio_seconds(sdk.live_at) > 0.5, 10, "the agent's audio")
        await until(lambda: app.room_empty() and app.status()["realtime"]["sockets_open"] == 0, 3, "the socket's slot")


async def test_four_callers_on_two_media_workers_and_a_killed_worker_ends_only_its_calls(app_with_workers):
    app = app_with_workers
    workers = app.status()["media_workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers)
    assert not any(w["torch_imported"] for w in workers)  # the media path never loads the model code
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        callers = await call_all(http, 4)
        await until(lambda: all(is_live(c) for c in callers), 30, "four live calls with transcripts")
        status = app.status()
        assert status["slots_live"] == 4
        assert sorted(w["calls"] for w in status["media_workers"]) == [2, 2]  # the least-loaded worker

        # Each caller's transcript is its own, and it streams: every page update extends the last.
        await asyncio.sleep(2.0)
        transcripts = [c.transcript for c in callers]
        assert len(set(transcripts)) == 4 and all(transcripts)
        for caller in callers:
            texts = [t for t, _ in caller.updates if t]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), caller.id

        # Hang-up frees the slot.
        await callers[0].hang_up()
        await until(lambda: app.status()["slots_free"] == 1, 5, "the hung-up caller's slot")

        # SIGKILL the worker that carries two of the remaining three calls... or one of them.
        pids = {w["pid"] for w in app.status()["media_workers"]}
        victim_pid = max(pids, key=lambda pid: sum(answer_ports(c) <= udp_ports_of(pid) for c in callers[1:]))
        ports = udp_ports_of(victim_pid)
        victims = [c for c in callers[1:] if answer_ports(c) <= ports]
        survivors = [c for c in callers[1:] if c not in victims]
        assert victims and survivors and len(victims) + len(survivors) == 3
        os.kill(victim_pid, signal.SIGKILL)
        said = [len(c.transcript) for c in survivors]
        # Its callers' pages are told; the engine frees their slots; the others keep talking (how
        # fast is the benchmarks' business: here, that audio and words keep coming).
        await until(lambda: all("media process" in c.status for c in victims), 10, "the victims' pages")
        await until(lambda: app.status()["slots_live"] == len(survivors), 10, "the victims' slots")
        heard = await asyncio.gather(*(c.audio_seconds_over(2.0) for c in survivors))
        assert all(s > 0.25 for s in heard), heard
        assert all(time.monotonic() - c.last_audio_at < 0.5 for c in survivors)
        assert all(len(c.transcript) > n for c, n in zip(survivors, said, strict=True))
        assert all(c.status.startswith("Live") for c in survivors)

        # A replacement worker comes up and takes the next call.
        await until(lambda: sum(w["alive"] for w in app.status()["media_workers"]) == 2, 90, "a replacement")
        (newcomer,) = await call_all(http, 1, first=4)
        await until(lambda: is_live(newcomer), 30, "a call on the replacement")
        assert victim_pid not in {w["pid"] for w in app.status()["media_workers"]}
        for caller in victims:
            await caller.hang_up()
        await survivors[0].hang_up()
        await until(lambda: app.status()["slots_free"] == 3, 5, "the hung-up callers' slots")
        log = app.log_text()
        assert "media worker" in log and "ending its" in log  # the main process says what happened

        # SIGTERM (a restart): the live caller hears why, and every process exits.
        worker_pids = [w["pid"] for w in app.status()["media_workers"]]
        stopping = asyncio.get_running_loop().run_in_executor(None, app.stop)
        await until(lambda: "restarting" in newcomer.status, 10, "the restart message on the page")
        assert await stopping < 10 and app.proc.returncode == 0
        await until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in worker_pids), 5, "the workers' exit")
        await newcomer.hang_up()


def place(caller: PageCaller) -> int | None:
    """The caller's place in the queue, as its page shows it."""
    found = re.search(r"you are number (\d+) in the queue", caller.status)
    return int(found.group(1)) if found else None


ONE_QUEUE_ARGS = ["--slots", "1", "--media-workers", "2", "--admission", "slots"]


async def test_one_queue_for_page_callers_on_two_media_workers_and_a_realtime_socket(tiny_cache_dir, tmp_path):
    with launched_app(tmp_path, tiny_cache_dir, args=["--devices", "cpu,cpu", *ONE_QUEUE_ARGS]) as app:
        await one_queue_for_everyone(app)


async def one_queue_for_everyone(app: LaunchedApp) -> None:
    """Two engines of one slot, two media workers: six page callers 0.3 s apart, one Realtime
    socket and one GPT-Live socket wait in one queue, kept by the main process, each in its own
    place in order of arrival; every hang-up seats the head of it."""
    await until(lambda: sum(w["alive"] for w in app.status()["media_workers"]) == 2, 90, "both workers")
    live_url = app.base_url.replace("http", "ws", 1) + "/v1/live/sessions"
    async with (httpx.AsyncClient(base_url=app.base_url, timeout=30) as http, SdkCaller(app.base_url, None) as sdk,
                ws_connect(live_url) as live_ws):
        live = LiveClient(live_ws)
        page = await PageConfig.fetch(http)
        callers: list[PageCaller] = []
        for i in range(6):
            caller = PageCaller(http, page, VOICES[i % 4], PERSONAS[i % 4], seed=i)
            await caller.offer(200.0 + 70 * i)
            await caller.wait_connected()
            callers.append(caller)
            await asyncio.sleep(0.3)  # the next caller arrives 0.3 s later
        assert sorted(w["calls"] for w in app.status()["media_workers"]) == [3, 3]
        await sdk.configure("VARF4", "You are a wise and friendly teacher.", seed=9)
        await until(lambda: all(is_live(c) for c in callers[:2]), 30, "the first two callers live")
        await until(lambda: [place(c) for c in callers[2:]] == [1, 2, 3, 4], 10,
                    f"places 1 to 4 in order of arrival (pages: {[c.status for c in callers[2:]]})")
        queued = await sdk.wait_event("personaplex.queue")
        assert queued.position == 5
        await live.send({"type": "session.start", "session": {"instructions": "You are a patient librarian.",
                                                               "personaplex": {"room_events": True}}})
        assert (await live.wait("personaplex.queue"))["position"] == 6
        assert app.status()["queue_length"] == 6
        # Every worker's pages count the room's whole queue.
        await until(lambda: all("6 waiting" in c.status for c in callers[2:]), 10,
                    f"the room's queue on every page (pages: {[c.status for c in callers[2:]]})")
        # Each hang-up of a live caller seats the head of the one queue, whichever worker holds it.
        for n in range(2):
            await callers[n].hang_up()
            await until(lambda n=n: is_live(callers[n + 2]), 30, f"caller {n + 2} seated after a hang-up")
            behind = callers[3 + n:]
            await until(lambda b=behind, n=n: [place(c) for c in b] == list(range(1, 4 - n)), 10,
                        f"the callers behind moving up (pages: {[c.status for c in behind]})")
        await sdk.wait_for(lambda: any(getattr(e, "position", None) == 3 for _, e in sdk.events
                                       if e.type == "personaplex.queue"), 10, "the socket at place 3")
        await until(lambda: any(e.get("position") == 4 for e in live.of("personaplex.queue")), 10,
                    "the GPT-Live socket at place 4")
        assert app.status()["queue_length"] == 4
        # The page's protocol: a waiting caller holds its microphone; a seated one sends it again.
        assert all(any(mic_hold.HOLD in m for m in c.messages) for c in callers[2:])
        assert all(c.held_mic is None for c in callers[2:4]) and all(c.held_mic is not None for c in callers[4:])
        for caller in callers[2:]:
            await caller.hang_up()
        await sdk.wait_live(30)  # the sockets' turn comes once the page callers have gone
        await live.wait("personaplex.live", timeout=30)
        await until(lambda: app.status()["calls_by_door"] == {"realtime": 1, "live": 1}, 5,
                    f"both sockets counted by their door ({app.status()['calls_by_door']})")
        await sdk.conn.close()
        await live_ws.close()
        await until(lambda: app.status()["slots_free"] == 2 and app.status()["queue_length"] == 0, 10,
                    "an empty room")
    # A caller's audio is not decoded while it waits, and is heard once it is seated: the four who
    # went live (two of them from the queue) were heard, and nobody's audio was decoded while waiting.
    closed = [(int(heard), int(waiting)) for heard, waiting in re.findall(
        r"closed after (\d+) packets in, \d+ frames out, (\d+) decoded while waiting", app.log.read_text())]
    assert len(closed) == 6 and sum(heard > 0 for heard, _ in closed) == 4, closed
    assert all(waiting == 0 for _, waiting in closed), closed


async def test_two_cpu_engines_with_int8_weights_each_take_a_call(tiny_cache_dir, tmp_path):
    args = ["--devices", "cpu,cpu", "--slots", "2", "--weights", "int8", "--admission", "slots"]
    with launched_app(tmp_path, tiny_cache_dir, args=args) as app:
        status = app.status()
        assert [e["name"] for e in status["engines"]] == ["engine-0 (cpu)", "engine-1 (cpu)"]
        # The engines hold their LM's transformer weights as int8, and the page's banner says so.
        assert status["weights"] == "int8" and "int8 weights" in status["banner"]
        # The runtime's facts come from the engines, as /api/status gives them for one in this process.
        assert status["device"] == "cpu" and status["capacity"]["slots"] == 2
        assert "loaded 151 tensors from model.safetensors (92 as int8)" in app.log_text()
        assert status["slots_total"] == 4
        assert len(status["media_workers"]) == default_media_workers(["cpu", "cpu"], 4)  # the default shape
        async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
            # A second caller, once the first shows in the engines' figures, goes to the engine
            # with more room: the other one (both on one engine would fit as well).
            callers = await call_all(http, 1)
            await until(lambda: sum(e["slots_live"] for e in app.status()["engines"]) == 1, 30, "the first call")
            callers += await call_all(http, 1, first=1)
            await until(lambda: all(is_live(c) for c in callers), 30, "two live calls")
            await until(lambda: sum(e["slots_live"] for e in app.status()["engines"]) == 2, 5, "the engines' figures")
            assert [e["slots_live"] for e in app.status()["engines"]] == [1, 1]
            assert callers[0].transcript != callers[1].transcript
            # /metrics adds up both engines, and their ticks reach its histograms.
            metrics = dict(line.rsplit(" ", 1) for line in app.metrics().splitlines() if line[:1] not in ("#", ""))
            assert float(metrics["personaplex_slots"]) == 4 and float(metrics["personaplex_slots_live"]) == 2
            assert float(metrics["personaplex_tick_seconds_count"]) > 0
            for caller in callers:
                await caller.hang_up()
            await until(lambda: app.status()["slots_free"] == 4, 5, "every slot free")


def test_the_engines_sockets_fit_however_long_the_temp_folder(monkeypatch, tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = ipc_directory()
    try:
        assert len(str(folder / "engine-15.sock")) < 100 and oct(folder.stat().st_mode)[-3:] == "700"
    finally:
        folder.rmdir()


def test_devices_and_the_default_number_of_media_workers(monkeypatch):
    assert resolve_devices(None, "cuda:1") == ["cuda:1"]
    assert resolve_devices("cuda:0, cuda:1", "auto") == ["cuda:0", "cuda:1"]
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert resolve_devices("all", "auto") == (gpus or ["cpu"])  # without a GPU: one engine on the CPU
    with pytest.raises(ValueError, match="comma-separated"):
        resolve_devices(" , ", "auto")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_media_workers(["cpu"], 8) == 4  # on a CPU the engine's arithmetic keeps most cores
    assert default_media_workers(["cuda:0"], 64) == 14  # a core each, two left for the page and engine
    assert default_media_workers(["cuda:0", "cuda:1"], 4) == 4  # never more workers than slots
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default_media_workers(["cuda:0"], 64) == 1
    # Live calls first wherever there are two cores: their media apart from the page's HTTP work.
    assert default_media_workers(["cpu"], 2) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_media_workers(["cpu"], 2) == 0 and default_media_workers(["cuda:0"], 8) == 0
