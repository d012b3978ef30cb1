"""Shared fixtures. Tiers: unit (no Ray), ray (one local instance per module),
cluster (a simulated multi-node cluster per module), chaos (opt-in: pytest -m chaos tests/chaos)."""

from __future__ import annotations

import os

import pytest

# Keep Ray quiet and small on a 2-core machine.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _local_ray(num_cpus: int):
    """Shut down any Ray this process holds; then (num_cpus > 0) start a local one."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if num_cpus:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    return ray


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (never joins another cluster on the machine)."""
    yield _local_ray(4)
    _local_ray(0)


@pytest.fixture(scope="module")
def ray_tune():
    """A local Ray with logical CPUs above the machine's: two to four ``raylane tune`` trials at once."""
    yield _local_ray(8)
    _local_ray(0)


@pytest.fixture(scope="session")
def _spot_market():
    """One simulated cluster for the whole session (starting one takes ~15 s)."""
    import ray

    from raylane.testing.spotmarket import SpotMarket

    if ray.is_initialized():
        ray.shutdown()
    market = SpotMarket(head_cpus=2)
    yield market
    if ray.is_initialized():
        ray.shutdown()
    market.shutdown()


SPOT_LAYOUT = {"spot-slow": 1.0, "spot-fast": 2.0}


@pytest.fixture()
def spot_cluster(_spot_market):
    """A heterogeneous simulated cluster: an on-demand head (2 CPUs) and two spot nodes,
    'spot-slow' (speed 1) and 'spot-fast' (speed 2), 2 CPUs each, with health checks short
    enough that a dead node is seen in ~2 s. Tests may remove nodes; missing ones are
    added back before the next test, and every test starts with all CPUs free."""
    import ray

    market = _spot_market
    if not ray.is_initialized() or ray.get_runtime_context().gcs_address != market.address:
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=market.address, log_to_driver=False)
    market.refill(SPOT_LAYOUT, timeout_s=60)
    return market


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The name of a user's module (tests/plugin_envs.py: a corridor env it registers, wrappers,
    network factories), written into a folder on the import path; unregistered afterwards."""
    import sys

    from plugin_envs import PLUGIN  # tests/plugin_envs.py

    name = f"raylane_test_envs_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    import gymnasium as gym

    gym.registry.pop("RaylaneTest/Corridor-v0", None)
