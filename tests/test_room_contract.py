"""The room contract (serving/room.py), held to every back end the app can run on.

One scenario, the same for each: two slots in all, a queue of three, a wait limit, callers who
arrive through different doors (and, with media workers, through different processes), hang up
while live or while waiting, go silent in the queue, wait too long, and lose their engines. What
must hold whatever the topology: first come, first served; every waiting caller has a place of
its own, and the room's queue counts all of them; a full queue refuses with a typed cause; the
room, not the door, ends a call that waited too long or whose audio stopped; a lost engine ends
its calls with a reason and turns new callers away.

The back ends: a `SlotPool` in this process; one engine behind its link (`RemotePool` and
`PoolServer`, as an engine process is reached); two engines behind the router; and two media
workers' rooms (`DeskRoom`) beside the main process's own door, sharing two engines through the
main process's one queue (`QueueDesk`). The messages between those rooms are pickled both ways,
as on the worker's channel. tests/test_media_workers.py runs the last one with real processes
and real WebRTC callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.procs.desk_room import DeskRoom
from personaplex_demo.procs.pool_router import PoolRouter
from personaplex_demo.procs.pool_server import PoolServer
from personaplex_demo.procs.queue_desk import QueueDesk
from personaplex_demo.procs.remote_pool import RemotePool
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.headroom import WaitReason
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.serving.room import DOORS, CallEnded, CallState, PoolClosedError, PoolFullError

from .support.waiting import eventually

KEY = secrets.token_bytes(16)
MAX_WAIT = 3.0
CONFIG = PoolConfig(max_queue=3, max_wait_seconds=MAX_WAIT, queued_silence_seconds=1.0, admission="slots",
                    idle_release_seconds=60.0, time_limit_seconds=None)
TONE = (0.3 * 32767 * np.sin(2 * np.pi * 220 * np.arange(960) / 24000)).astype(np.int16)
BACK_ENDS = ["slot pool", "one engine link", "two engines", "two media workers"]


@dataclass
class BackEnd:
    doors: list[Any]  # the rooms the doors hold; arriving callers take them in turn
    room: Any  # the app's room: its figures count every caller
    lose_engines: Callable[[], None]  # every engine stops under its calls


@pytest.fixture(scope="module")
def runtimes(tiny_cache_dir):
    """One engine of two slots, and two of one slot each."""
    return {"two": build_runtime(RuntimeOptions(model="tiny", slots=2, cache_dir=tiny_cache_dir)),
            "one": [build_runtime(RuntimeOptions(model="tiny", slots=1, cache_dir=tiny_cache_dir)) for _ in range(2)]}


@contextlib.contextmanager
def engine_server(runtime, address: str, name: str):
    pool = SlotPool(runtime.engine, CONFIG)
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


@contextlib.asynccontextmanager
async def back_end(kind: str, runtimes, tmp_path) -> AsyncIterator[BackEnd]:
    if kind == "slot pool":
        pool = SlotPool(runtimes["two"].engine, CONFIG)
        pool.start()
        try:
            yield BackEnd([pool], pool, pool.shutdown)
        finally:
            pool.shutdown()
        return
    with contextlib.ExitStack() as stack:
        if kind == "one engine link":
            addresses = [str(tmp_path / "engine.sock")]
            servers = [stack.enter_context(engine_server(runtimes["two"], addresses[0], "e0"))]
        else:
            addresses = [str(tmp_path / f"e{i}.sock") for i in range(2)]
            servers = [stack.enter_context(engine_server(rt, a, f"e{i}"))
                       for i, (rt, a) in enumerate(zip(runtimes["one"], addresses, strict=True))]

        def lose() -> None:
            for server in servers:
                server.close()

        links = [RemotePool(a, KEY) for a in addresses]
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

            workers[worker] = DeskRoom([RemotePool(a, KEY) for a in addresses], to_desk)
        yield BackEnd([workers[1], workers[2], router], router, lose)
        for room in workers.values():
            room.close()
        router.close()


async def until_ended(call, seconds: float = 10.0) -> str:
    """Read the call's outputs until it has ended; its reason."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await call.next_output(timeout=0.5)
        except CallEnded as ended:
            return ended.reason
    raise AssertionError(f"{call} did not end within {seconds:.0f} s")


async def turned_away(door, seconds: float = 5.0) -> None:
    """`door`'s room refuses a newcomer (PoolClosedError) once it has seen its engines go."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            call = await door.acquire("NATF2", "", SamplingParams(seed=99))
        except PoolClosedError:
            return
        call.release()
        assert time.monotonic() < deadline, f"{door} still takes calls {seconds:.0f} s after its engines stopped"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", BACK_ENDS)
async def test_every_back_end_keeps_the_rooms_one_queue_and_its_rules(kind, runtimes, tmp_path):
    async with back_end(kind, runtimes, tmp_path) as it:
        arrivals = 0

        async def arrive():
            nonlocal arrivals
            door = it.doors[arrivals % len(it.doors)]
            arrivals += 1
            return await door.acquire("NATF2", "", SamplingParams(seed=arrivals), door=DOORS[arrivals % 2])

        first, second = await arrive(), await arrive()
        for call in (first, second):
            await call.wait_live(20)
        # Four more callers through every door in turn: the first three wait, each in its own
        # place, in the order they came; the room counts all of them; the fourth is refused.
        waiting = [await arrive() for _ in range(3)]

        def places():
            return [c.queue_position for c in waiting]

        await eventually(lambda: places() == [1, 2, 3], f"places 1, 2, 3 (have {places()})")
        assert [(c.state, c.wait_reason) for c in waiting] == [(CallState.QUEUED, WaitReason.SLOTS)] * 3
        await eventually(lambda: it.room.snapshot().queue_length == 3, "the room counting its queue")
        with pytest.raises(PoolFullError) as refused:
            await arrive()
        assert refused.value.cause == WaitReason.SLOTS and "queue" in str(refused.value)

        # A waiting caller hangs up: it leaves, and the one behind it moves up.
        waiting[1].release()
        with pytest.raises(CallEnded):
            await waiting[1].wait_live(5)
        await eventually(lambda: places() == [1, None, 2], f"places 1, -, 2 (have {places()})")

        # A live caller hangs up: the head of the queue takes the slot, the next is now first.
        first.release()
        await waiting[0].wait_live(10)
        await eventually(lambda: waiting[2].queue_position == 1, "the last caller moving up to 1")

        # A waiting caller whose audio stops has gone: the room gives its place up.
        waiting[2].push_audio(TONE)
        assert await until_ended(waiting[2], 5.0) == "idle"

        # One that never sent audio waits until the wait limit, on the room's clock.
        late = await arrive()
        came = time.monotonic()
        await eventually(lambda: late.queue_position == 1, "the late caller in first place")
        assert await until_ended(late, MAX_WAIT + 5.0) == "queue_timeout"
        assert time.monotonic() - came >= MAX_WAIT - 0.3

        # The engines stop: their live calls end with a reason, and newcomers are turned away.
        await eventually(lambda: it.room.snapshot().queue_length == 0, "an empty queue")
        it.lose_engines()
        reasons = [await until_ended(c) for c in (second, waiting[0])]
        assert all(reason in ("shutdown",) or reason.startswith("error:") for reason in reasons), reasons
        for door in it.doors:
            await turned_away(door)
