"""Helpers for the tests on the simulated spot cluster (tests/cluster, tests/chaos)."""

from __future__ import annotations

import time

from raylane.cluster import ClusterView


def wait_all_free(timeout_s: float = 60.0) -> None:
    """Killed actors release their CPUs asynchronously; placement reads free resources."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(n.available.get("CPU", 0) == n.cpus for n in ClusterView.from_ray().usable):
            return
        time.sleep(0.2)
    raise TimeoutError("cluster CPUs were not released in time")


def by_name(market, name: str):
    """The market's node called ``name``."""
    return next(n for n in market.nodes.values() if n.name == name)
