"""A Ray cluster of N nodes on this machine, each offering one tiny CPU engine, for the benchmarks
of `--engines ray` (bench/media.py --ray-nodes N). Prints the cluster's address on its first line,
then runs until SIGTERM or SIGINT; its process tree holds every Ray process of the cluster, so
its CPU can be read with the app's.

    python bench/ray_cluster.py 2
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from personaplex_demo.orchestration.ray.engines import ENGINE_RESOURCE  # noqa: E402


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    node = {"num_cpus": 1, "resources": {ENGINE_RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    print(cluster.address, flush=True)
    try:
        signal.sigwait([signal.SIGTERM, signal.SIGINT])
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT])
    main()
