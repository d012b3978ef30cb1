"""Helpers for the tests on the simulated spot cluster (tests/cluster, tests/chaos), and waiting for
killed actors to free their CPUs on any Ray."""

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


def notice_then_remove(market, log: list, *, notice_at: int, remove_at: int, notice_s: float = 6.0):
    """The chaos schedule the parameter-server and XGBoost cases share, as a ``during``
    schedule for ``harness.drive``: once ``notice_at`` step calls have begun, the first spot
    node by name is preempted with ``notice_s`` of notice; at ``remove_at`` the last one is
    removed without notice; each comes back at once. What happened goes into ``log``."""

    def schedule(steps) -> None:
        for at, pick, notice in ((notice_at, 0, True), (remove_at, -1, False)):
            steps.wait(at)
            victim = sorted(market.spot_nodes(), key=lambda n: n.name)[pick]
            log.append(f"{'notice' if notice else 'remove'} {victim.name} at step {len(steps)}")
            if notice:
                market.preempt(victim, notice_s=notice_s)
            else:
                market.remove(victim)
            market.add_node("spot", speed=victim.speed, cpus=2, name=victim.name)

    return schedule
