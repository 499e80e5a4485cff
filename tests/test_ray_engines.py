"""`--engines ray`: the engines are Ray actors on the nodes of a cluster, behind the same room.

A two-node `ray.cluster_utils.Cluster` on this machine, each node offering one engine (the
`personaplex_engine` resource), and the app launched as a user starts it, joining that cluster.
Callers are aiortc peers that drive the page's own events (`callers.PageCaller`). The failures
are real ones: an engine's process killed, frozen (SIGSTOP: silent, as a machine cut off from the
network is) and its node removed from the cluster.

Ray is an optional extra: without it these tests are skipped, except under CI=true.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx
import pytest

from .browser_support import IN_CI, LaunchedApp, launched_app
from .test_media_workers import call_all, is_live, until

if not IN_CI:
    pytest.importorskip("ray", reason="Ray is an optional extra (requirements-ray.txt)")

from ray.cluster_utils import Cluster  # noqa: E402

from personaplex_demo.orchestration.ray.engines import ENGINE_RESOURCE  # noqa: E402

pytestmark = pytest.mark.usefixtures("loopback_ice")

NOTICE_SECONDS = 3.0  # a failed engine's callers are told within this
log = logging.getLogger(__name__)


@pytest.fixture(scope="module", params=["embedded", "media workers"])
def cluster(request):
    """A fresh cluster for each way the app carries its callers: in its own process, or in a
    media worker, which links to the engines (and relinks to one that came back) on its own."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node = {"num_cpus": 1, "resources": {ENGINE_RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.media_workers = request.param == "media workers"
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def app(cluster, tiny_cache_dir, tmp_path_factory) -> LaunchedApp:
    # Admission by slot count: two tiny engines on two cores are not real time on every host, and
    # these tests follow placement and failures, not speed (bench/media.py measures that).
    args = ["--engines", "ray", "--ray-address", cluster.address, "--slots", "2", "--admission", "slots",
            "--idle-release", "30", "--media-workers", "1" if cluster.media_workers else "0"]
    with launched_app(tmp_path_factory.mktemp("app"), tiny_cache_dir, args=args) as app:
        yield app


def engines(app: LaunchedApp) -> list[dict]:
    return app.status()["engines"]


async def all_live(app: LaunchedApp, callers) -> None:
    """Every caller live with a transcript; if not, the failure says where the engines stood."""
    try:
        await until(lambda: all(is_live(c) for c in callers), 60, f"{len(callers)} live calls")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; statuses {[c.status for c in callers]}; engines {engines(app)}") from None


def told(caller, words: str = "the engine on") -> bool:
    return words in caller.status


async def fail_and_check(callers, fail) -> None:
    """Run `fail` on one of two full engines: its two calls end with a message within
    NOTICE_SECONDS and the other two keep receiving audio and words."""
    failed_at = time.monotonic()
    await asyncio.to_thread(fail)  # removing a node takes a while: the callers go on meanwhile
    try:
        await until(lambda: any(told(c) for c in callers), NOTICE_SECONDS + 2, "a message on a victim's page")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; statuses {[c.status for c in callers]}") from None
    await asyncio.sleep(0.5)  # the other victims' pages
    victims = [c for c in callers if told(c)]
    survivors = [c for c in callers if not told(c)]
    assert len(victims) == len(survivors) == 2, [c.status for c in callers]
    assert all(c.ended is not None or "ended" in c.status.lower() for c in victims), [c.status for c in victims]
    notice = max(t for t in (c.told_at for c in victims) if t is not None) - failed_at
    log.info("the last victim's page was told %.2f s after the failure", notice)
    assert notice < NOTICE_SECONDS, f"told after {notice:.1f} s"
    said = [len(c.transcript) for c in survivors]
    heard = await asyncio.gather(*(c.audio_seconds_over(2.0) for c in survivors))
    assert all(s > 0.25 for s in heard), heard
    assert all(len(c.transcript) > n for c, n in zip(survivors, said, strict=True))
    assert all(c.status.startswith("Live") for c in survivors), [c.status for c in survivors]


def watch_for_notice(callers) -> None:
    """Note when each caller's page first shows the engine's failure."""
    for caller in callers:
        caller.told_at = None
        show = caller._show

        def shown(values, caller=caller, show=show):
            show(values)
            if caller.told_at is None and told(caller):
                caller.told_at = time.monotonic()

        caller._show = shown


async def test_four_callers_spread_over_two_ray_engines_on_two_nodes(app):
    rows = engines(app)
    assert [r["name"] for r in rows] == ["engine-0", "engine-1"] and all(r["alive"] for r in rows)
    assert len({r["node_id"] for r in rows}) == 2  # one engine on each node
    assert app.status()["slots_total"] == 4
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        # A second caller, once the first shows in the engines' figures, goes to the engine with
        # more room: the other node (both on one engine would fit too: this is placement).
        callers = await call_all(http, 1)
        await all_live(app, callers)
        await until(lambda: sum(r["slots_live"] for r in engines(app)) == 1, 5, "the engines' figures")
        callers += await call_all(http, 1, first=1)
        await all_live(app, callers)
        await until(lambda: sum(r["slots_live"] for r in engines(app)) == 2, 5, "the engines' figures")
        assert [r["slots_live"] for r in engines(app)] == [1, 1]
        callers += await call_all(http, 2, first=2)
        await all_live(app, callers)
        await until(lambda: [r["slots_live"] for r in engines(app)] == [2, 2], 5, "four calls on two engines")
        transcripts = [c.transcript for c in callers]
        assert len(set(transcripts)) == 4 and all(transcripts)
        # /metrics labels every engine with its node and device.
        metrics = app.metrics()
        for row in engines(app):
            assert (f'personaplex_engine_slots_live{{device="cpu",engine="{row["name"]}",node="{row["node"]}"}} 2.0'
                    in metrics), metrics
        # A fifth caller waits in the queue, with its place shown, and gets in when a slot frees.
        (fifth,) = await call_all(http, 1, first=4)
        await until(lambda: "queue" in fifth.status.lower(), 20, "the fifth caller's place in the queue")
        assert app.status()["queue_length"] == 1
        await callers[0].hang_up()
        await until(lambda: is_live(fifth), 30, "the fifth caller live")
        for caller in [*callers[1:], fifth]:
            await caller.hang_up()
        await until(lambda: app.status()["slots_free"] == 4, 5, "every slot free")


async def test_a_killed_engine_actor_ends_only_its_calls_and_comes_back(app):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        callers = await call_all(http, 4)
        await all_live(app, callers)
        await asyncio.sleep(1.0)
        victim = engines(app)[0]
        watch_for_notice(callers)
        await fail_and_check(callers, lambda: os.kill(victim["pid"], signal.SIGKILL))
        # Ray restarts the actor; the app links to it again and gives it new calls.
        await until(lambda: engines(app)[0]["alive"] and engines(app)[0]["pid"] != victim["pid"], 60,
                    "the engine back")
        (newcomer,) = await call_all(http, 1, first=4)
        await until(lambda: is_live(newcomer), 30, "a call on the engine that came back")
        await asyncio.sleep(1.0)
        assert [r["slots_live"] for r in engines(app)] == [1, 2]
        for caller in [*callers, newcomer]:
            await caller.hang_up()
        await until(lambda: app.status()["slots_free"] == 4, 5, "every slot free")
    assert "engine-0: connection lost; ending its calls" in app.log_text()


async def test_a_silent_engine_is_given_up_within_seconds_and_relinked_when_it_speaks_again(app):
    """SIGSTOP: the process holds its sockets open and says nothing, as a machine cut off does."""
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        callers = await call_all(http, 4)  # two on each engine: every slot is taken
        await all_live(app, callers)
        await asyncio.sleep(1.0)
        victim = engines(app)[1]
        watch_for_notice(callers)
        try:
            await fail_and_check(callers, lambda: os.kill(victim["pid"], signal.SIGSTOP))
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        assert "engine-1: no word for" in app.log_text()
        await until(lambda: engines(app)[1]["alive"], 20, "the engine relinked")
        assert engines(app)[1]["pid"] == victim["pid"]  # the same actor: it never died
        for caller in callers:
            await caller.hang_up()
        await until(lambda: app.status()["slots_free"] == 4, 5, "every slot free")


async def test_a_removed_node_ends_only_its_engines_calls(app, cluster):
    async with httpx.AsyncClient(base_url=app.base_url, timeout=30) as http:
        callers = await call_all(http, 4)
        await all_live(app, callers)
        await asyncio.sleep(1.0)
        (node,) = cluster.worker_nodes
        (victim,) = [r for r in engines(app) if r["node_id"] == node.node_id]
        watch_for_notice(callers)
        await fail_and_check(callers, lambda: cluster.remove_node(node, allow_graceful=False))
        # The room now counts the one engine left.
        await until(lambda: app.status()["slots_total"] == 2, 5, "the room without the lost engine")
        live = [c for c in callers if not told(c)]
        if cluster.media_workers:
            # A media worker that dies now is replaced by one that links to the engine left and
            # waits for the lost one without failing; it takes new calls.
            (worker,) = app.status()["media_workers"]
            os.kill(worker["pid"], signal.SIGKILL)
            await until(lambda: all("media process" in c.status for c in live), 10, "the worker's callers told")
            await until(lambda: [w["alive"] for w in app.status()["media_workers"]] == [True], 90, "a new worker")
            for caller in callers:
                await caller.hang_up()
            await until(lambda: app.status()["slots_free"] == 2, 10, "the lost worker's slots")
            live = await call_all(http, 1, first=4)
            await all_live(app, live)
        # SIGTERM (a restart): the live callers hear why, and the app exits in time, its lost
        # engine (waiting for a node to restart on) notwithstanding.
        stopping = asyncio.get_running_loop().run_in_executor(None, app.stop)
        await until(lambda: all("restarting" in c.status for c in live), 10, "the restart message")
        assert await stopping < 10 and app.proc.returncode == 0
        for caller in [*callers, *live]:
            await caller.hang_up()
