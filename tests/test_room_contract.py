"""The room contract (serving/room.py), held to every back end the app can run on.

One scenario, the same for each: two slots in all, a queue of three, a wait limit, callers who
arrive through different doors (and, with media workers, through different processes), hang up
while live or while waiting, go silent in the queue, wait too long, and lose their engines. What
must hold whatever the topology: first come, first served; every waiting caller has a place of
its own, and the room's queue counts all of them; a full queue refuses with a typed cause; the
room, not the door, ends a call that waited too long or whose audio stopped; a lost engine ends
its calls with a reason and turns new callers away.

The back ends: a `SlotPool` in this process; one engine behind its link (`EngineLink` and
`PoolServer`, as an engine process is reached); two engines behind the router; two media
workers' rooms (`DeskRoom`) beside the main process's own door, sharing two engines through the
main process's one queue (`QueueDesk`); and two engines as Ray actors on the two nodes of a
cluster (skipped without Ray, except under CI=true). The messages between those rooms are pickled both ways,
as on the worker's channel. tests/test_media_workers.py runs the last one with real processes
and real WebRTC callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.procs.engine_link import EngineLink
from personaplex_demo.procs.pool_router import PoolRouter
from personaplex_demo.procs.pool_server import PoolServer
from personaplex_demo.procs.queue_desk import DeskRoom, QueueDesk
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.door import DoorCall, Ended, Queued, RefusalKind
from personaplex_demo.serving.headroom import WaitReason
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import (
    CallHandle,
    CallState,
    Room,
)

from .browser_support import IN_CI
from .support.waiting import eventually

KEY = secrets.token_bytes(16)
# The queue's scenario runs without a wait limit (it takes longer on a slower host); the wait limit
# has a room of its own, in which nothing else happens.
QUEUE_RULES = PoolConfig(max_queue=3, max_wait_seconds=None, admission="slots",
                         idle_release_seconds=60.0, time_limit_seconds=None)
MAX_WAIT = 2.0
WAIT_LIMIT = dataclasses.replace(QUEUE_RULES, max_wait_seconds=MAX_WAIT)
TONE = (0.3 * 32767 * np.sin(2 * np.pi * 220 * np.arange(960) / 24000)).astype(np.int16)
BACK_ENDS = ["slot pool", "one engine link", "two engines", "two media workers", "Ray, two nodes"]


@dataclass
class BackEnd:
    doors: list[Any]  # the rooms the doors hold; arriving callers take them in turn
    room: Any  # the app's room: its figures count every caller
    lose_engines: Callable[[], None]  # every engine stops under its calls


@pytest.fixture(scope="module")
def runtimes(tiny_cache_dir):
    """One engine of two slots, and two of one slot each."""
    return {"cache_dir": tiny_cache_dir,
            "two": build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir)),
            "one": [build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir)) for _ in range(2)]}


@contextlib.contextmanager
def engine_server(runtime, address: str, name: str, config: PoolConfig):
    pool = SlotPool(runtime.engine, config)
    pool.start()
    server = PoolServer(pool, address, KEY, name=name).start()
    try:
        yield server
    finally:
        server.close()
        pool.shutdown()


def relayed(message: Any) -> Any:
    """A message as the other process gets it."""
    return pickle.loads(pickle.dumps(message))


@contextlib.contextmanager
def ray_engines(cache_dir: Path, config: PoolConfig) -> Iterator[Any]:
    """Two engines of one slot as Ray actors, one on each node of a two-node cluster on this
    machine, as `--engines ray` starts them (orchestration/ray/engines.py)."""
    if not IN_CI:
        pytest.importorskip("ray", reason="Ray is an optional extra (requirements-ray.txt)")
    import ray
    from ray.cluster_utils import Cluster

    from personaplex_demo.orchestration.ray.engines import ENGINE_RESOURCE, RayEngines, connect, new_spec

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node = {"num_cpus": 1, "resources": {ENGINE_RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    try:
        connect(cluster.address, logging.INFO)
        spec = new_spec(RuntimeOptions(model="tiny", slots=1, cache_dir=cache_dir), config, logging.INFO)
        engines = RayEngines(spec, started_ray=False).start()
        try:
            yield engines
        finally:
            engines.close()
            ray.shutdown()
    finally:
        cluster.shutdown()


def kill_actors(engines) -> None:
    import ray

    for row in engines.status():
        ray.kill(ray.get_actor(row["actor"], namespace=engines.namespace), no_restart=True)


@contextlib.asynccontextmanager
async def back_end(kind: str, runtimes, tmp_path, config: PoolConfig) -> AsyncIterator[BackEnd]:
    if kind == "Ray, two nodes":
        with ray_engines(runtimes["cache_dir"], config) as engines:
            router = await asyncio.to_thread(engines.wait_ready)
            yield BackEnd([router], router, lambda: kill_actors(engines))
        return
    if kind == "slot pool":
        pool = SlotPool(runtimes["two"].engine, config)
        pool.start()
        try:
            yield BackEnd([pool], pool, pool.shutdown)
        finally:
            pool.shutdown()
        return
    with contextlib.ExitStack() as stack:
        if kind == "one engine link":
            addresses = [str(tmp_path / "engine.sock")]
            servers = [stack.enter_context(engine_server(runtimes["two"], addresses[0], "e0", config))]
        else:
            addresses = [str(tmp_path / f"e{i}.sock") for i in range(2)]
            servers = [stack.enter_context(engine_server(rt, a, f"e{i}", config))
                       for i, (rt, a) in enumerate(zip(runtimes["one"], addresses, strict=True))]

        def lose() -> None:
            for server in servers:
                server.close()

        links = [EngineLink(a, KEY) for a in addresses]
        if kind == "one engine link":
            yield BackEnd([links[0]], links[0], lose)
            links[0].close()
            return
        router = PoolRouter(links)
        if kind == "two engines":
            yield BackEnd([router], router, lose)
            router.close()
            return
        loop = asyncio.get_running_loop()
        workers: dict[int, DeskRoom] = {}
        desk = QueueDesk(router, lambda worker, m: loop.call_soon(workers[worker].receive, relayed(m)))
        for worker in (1, 2):
            def to_desk(m: Any, worker: int = worker) -> None:
                loop.call_soon(desk.receive, worker, relayed(m))

            workers[worker] = DeskRoom([EngineLink(a, KEY) for a in addresses], to_desk)
        yield BackEnd([workers[1], workers[2], router], router, lose)
        for room in workers.values():
            room.close()
        router.close()


async def until_ended(caller: DoorCall, seconds: float = 10.0) -> str:
    """Pass the caller's events on, as a door does, until its call has ended; the reason."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if isinstance(event := await caller.next_event(0.5), Ended):
            return event.reason
    raise AssertionError(f"{caller.call} did not end within {seconds:.0f} s")


async def turned_away(room, seconds: float = 5.0) -> None:
    """`room` refuses a newcomer as closed once it has seen its engines go."""
    deadline = time.monotonic() + seconds
    while True:
        caller = DoorCall(room, "page")
        refusal = await caller.start("NATF2", "", SamplingParams(seed=99))
        if refusal is not None:
            assert refusal.kind == RefusalKind.CLOSED, refusal
            return
        caller.hang_up()
        assert time.monotonic() < deadline, f"{room} still takes calls {seconds:.0f} s after its engines stopped"
        await asyncio.sleep(0.05)


DOORS = ("page", "realtime", "live")  # labels the room counts by


class Arrivals:
    """Callers through the doors' common part (`DoorCall`), the page's, the Realtime socket's and
    the GPT-Live socket's labels in turn, each through the next of the rooms a door may hold."""

    def __init__(self, rooms: list[Any]) -> None:
        self.rooms, self.count = rooms, 0

    async def arrive(self, refused: bool = False) -> DoorCall:
        room = self.rooms[self.count % len(self.rooms)]
        self.count += 1
        caller = DoorCall(room, DOORS[self.count % len(DOORS)])
        refusal = await caller.start("NATF2", "", SamplingParams(seed=self.count))
        assert (refusal is not None) == refused, refusal
        caller.refusal = refusal
        return caller


@pytest.mark.parametrize("kind", BACK_ENDS)
async def test_every_back_end_keeps_the_rooms_one_queue_and_its_rules(kind, runtimes, tmp_path):
    async with back_end(kind, runtimes, tmp_path, QUEUE_RULES) as it:
        arrive = Arrivals(it.doors).arrive
        assert all(isinstance(room, Room) for room in [*it.doors, it.room])  # the Protocol's surface
        first, second = await arrive(), await arrive()
        for caller in (first, second):
            await caller.call.wait_live(20)
        # Four more callers through every door in turn: the first three wait, each in its own
        # place, in the order they came; the room counts all of them; the fourth is refused.
        waiting = [await arrive() for _ in range(3)]
        assert all(isinstance(c.call, CallHandle) for c in (first, second, *waiting))

        def places():
            return [c.call.queue_position for c in waiting]

        await eventually(lambda: places() == [1, 2, 3], f"places 1, 2, 3 (have {places()})")
        assert [(c.state, c.call.wait_reason) for c in waiting] == [(CallState.QUEUED, WaitReason.SLOTS)] * 3
        assert [await c.next_event(1.0) for c in waiting] == [Queued(n, WaitReason.SLOTS) for n in (1, 2, 3)]
        await eventually(lambda: it.room.snapshot().queue_length == 3, "the room counting its queue")
        refused = (await arrive(refused=True)).refusal
        assert refused.kind == RefusalKind.FULL and refused.cause == WaitReason.SLOTS
        assert "queue" in str(refused.error)

        # A waiting caller hangs up: it leaves, and the one behind it moves up.
        waiting[1].hang_up()
        assert await until_ended(waiting[1], 5.0) == "hangup"
        await eventually(lambda: places() == [1, None, 2], f"places 1, -, 2 (have {places()})")
        assert await waiting[2].next_event(5.0) == Queued(2, WaitReason.SLOTS)

        # A live caller hangs up: the head of the queue takes the slot, the next is now first.
        first.hang_up()
        await waiting[0].call.wait_live(10)
        await eventually(lambda: waiting[2].call.queue_position == 1, "the last caller moving up to 1")

        # A waiting caller's audio is not heard yet, and neither its audio nor its silence moves
        # anyone: only a hang-up (or the room's wait limit) ends a wait. A duration is what is
        # tested here: a second of audio, then a second of silence.
        silent = await arrive()
        await eventually(lambda: silent.call.queue_position == 2, "the newcomer in second place")
        for _ in range(25):
            waiting[2].push(TONE)
            await asyncio.sleep(0.04)
        await asyncio.sleep(1.0)
        assert [(c.state, c.call.queue_position) for c in (waiting[2], silent)] == [(CallState.QUEUED, 1),
                                                                                    (CallState.QUEUED, 2)]
        waiting[2].hang_up()
        silent.hang_up()

        # The engines stop: their live calls end with a reason, and newcomers are turned away.
        await eventually(lambda: it.room.snapshot().queue_length == 0, "an empty queue")
        it.lose_engines()
        reasons = [await until_ended(c) for c in (second, waiting[0])]
        assert all(reason == "shutdown" or reason.startswith("error:") for reason in reasons), reasons
        for room in it.doors:
            await turned_away(room)


@pytest.mark.parametrize("kind", BACK_ENDS)
async def test_every_back_end_ends_a_wait_that_ran_past_the_limit_on_its_own_clock(kind, runtimes, tmp_path):
    async with back_end(kind, runtimes, tmp_path, WAIT_LIMIT) as it:
        arrive = Arrivals(it.doors).arrive
        seated = [await arrive(), await arrive()]
        for caller in seated:
            await caller.call.wait_live(20)
        late = await arrive()
        came = time.monotonic()
        assert await late.next_event(5.0) == Queued(1, WaitReason.SLOTS)
        assert await until_ended(late, MAX_WAIT + 10.0) == "queue_timeout"
        assert time.monotonic() - came >= MAX_WAIT - 0.3  # not before the limit (a slow host ends it later)
        for caller in seated:
            caller.hang_up()
        await eventually(lambda: it.room.snapshot().queue_length == 0, "an empty queue")
