"""`--engines ray` with media workers: the room's one queue is the main process's, whatever
machine each engine runs on. A two-node `ray.cluster_utils.Cluster` on this machine, one engine
of one slot on each node, two media workers, and the scenario of test_media_workers.py: six page
callers 0.3 s apart and one Realtime socket, each with a place of its own in order of arrival.

Ray is an optional extra: without it this test is skipped, except under CI=true.
"""

from __future__ import annotations

import os

import pytest

from .browser_support import IN_CI, launched_app
from .test_media_workers import ONE_QUEUE_ARGS, one_queue_for_everyone

if not IN_CI:
    pytest.importorskip("ray", reason="Ray is an optional extra (requirements-ray.txt)")

from ray.cluster_utils import Cluster  # noqa: E402

from personaplex_demo.orchestration.ray.engines import ENGINE_RESOURCE  # noqa: E402

pytestmark = pytest.mark.usefixtures("loopback_ice")


@pytest.fixture
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node = {"num_cpus": 1, "resources": {ENGINE_RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    yield cluster
    cluster.shutdown()


async def test_one_queue_across_two_ray_nodes_two_media_workers_and_the_realtime_door(cluster, tiny_cache_dir,
                                                                                        tmp_path):
    args = ["--engines", "ray", "--ray-address", cluster.address, *ONE_QUEUE_ARGS]
    with launched_app(tmp_path, tiny_cache_dir, args=args) as app:
        assert len({row["node_id"] for row in app.status()["engines"]}) == 2  # one engine on each node
        await one_queue_for_everyone(app)
