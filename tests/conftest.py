"""Shared fixtures. Tiers: unit (no Ray), ray (one local instance per module),
cluster (a simulated multi-node cluster per module), chaos and slow (opt-in)."""

from __future__ import annotations

import os

import pytest

# Keep Ray quiet and small on a 2-core machine.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (never joins another cluster on the machine)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def spot_cluster():
    """A heterogeneous simulated cluster: an on-demand head (2 CPUs) and two spot nodes,
    speeds 1 and 2, with health checks short enough that a dead node is seen in ~2 s."""
    import ray

    from raylane.spotmarket import SpotMarket

    if ray.is_initialized():
        ray.shutdown()
    market = SpotMarket(head_cpus=2)
    market.add_node("spot", speed=1.0, cpus=2, name="spot-slow")
    market.add_node("spot", speed=2.0, cpus=2, name="spot-fast")
    ray.init(address=market.address, log_to_driver=False)
    yield market
    ray.shutdown()
    market.shutdown()
