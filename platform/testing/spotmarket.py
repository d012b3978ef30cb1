"""A simulated spot market on ``ray.cluster_utils.Cluster``, for tests and benchmarks.

Test and benchmark support only: no production path (the CLI, the driver, the jobs)
imports it.

It starts a real multi-node Ray cluster on this machine (every node a real raylet),
labels nodes with their market and speed the way a cloud cluster would, and takes
nodes away the way a spot market does: with a notice (Ray's drain API with the
PREEMPTION reason and a deadline, then removal) or without one (removal). Ray's
health checks are shortened so a removed node is marked dead within about 2 s.

Example::

    market = SpotMarket(head_cpus=2)
    fast = market.add_node("spot", speed=2.0, cpus=2)
    ray.init(address=market.address)
    market.preempt(fast, notice_s=2.0)       # drain with a deadline, remove, wait until dead
    market.add_node("spot", speed=2.0)        # a replacement
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from raylane.cluster import MARKET_LABEL, SPEED_LABEL

# Dead nodes are noticed after period * threshold (~1.5 s). The per-check timeout is
# generous so a busy 2-core machine does not declare a healthy node dead.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 300,
    "health_check_failure_threshold": 5,
    "health_check_initial_delay_ms": 0,
    "health_check_timeout_ms": 2000,
}


@dataclass
class SimNode:
    """A node the market started."""

    name: str
    market: str
    speed: float
    cpus: float
    node: object = field(repr=False)

    @property
    def node_id(self) -> str:
        return self.node.node_id  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MarketEvent:
    """One scheduled action: at ``at`` seconds, ``preempt`` (with ``notice_s``) or ``remove`` a spot node."""

    at: float
    action: str
    notice_s: float = 0.0
    replace_after_s: float | None = 2.0


def random_schedule(seed: int, *, events: int, every_s: float, notice_s: float = 0.0, notice_share: float = 0.5, replace_after_s: float | None = 2.0) -> list[MarketEvent]:
    """A seeded schedule: ``events`` spot losses roughly ``every_s`` apart, a share of them with notice."""
    if events < 0 or every_s <= 0:
        raise ValueError(f"need events >= 0 and every_s > 0, got events={events}, every_s={every_s}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(events):
        t += every_s * rng.uniform(0.75, 1.25)
        with_notice = rng.random() < notice_share
        out.append(MarketEvent(round(t, 3), "preempt" if with_notice else "remove", notice_s if with_notice else 0.0, replace_after_s))
    return out


class SpotMarket:
    """A real multi-node Ray cluster on this machine whose spot nodes come and go."""

    def __init__(self, *, head_cpus: float = 2, head_market: str = "on-demand", head_speed: float | None = 1.0, object_store_mb: int = 128, system_config: dict | None = None):
        from ray.cluster_utils import Cluster

        labels = {MARKET_LABEL: head_market}
        if head_speed is not None:
            labels[SPEED_LABEL] = _fmt_speed(head_speed)
        cfg = dict(FAST_HEALTH_CHECKS)
        cfg.update(system_config or {})
        self._object_store = object_store_mb * 1024 * 1024
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "labels": labels,
                "object_store_memory": self._object_store,
                "include_dashboard": False,
                "_system_config": cfg,
            },
        )
        self.nodes: dict[str, SimNode] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._add_lock = threading.Lock()
        self.log: list[tuple[float, str, str]] = []

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_node_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_node(self, market: str = "spot", *, speed: float | None = 1.0, cpus: float = 1, gpus: float = 0, name: str | None = None) -> SimNode:
        """Start a node with the market and speed labels; returns once Ray lists it.
        ``speed=None`` leaves the speed label off, so raylane measures the node."""
        if market not in ("spot", "on-demand"):
            raise ValueError(f"market must be 'spot' or 'on-demand', got {market!r}")
        with self._lock:
            self._count += 1
            name = name or f"{market}-{self._count}"
        # Ray registers exit hooks (signal handlers) for each node it starts, which only
        # works on the main thread. A node added from a schedule thread skips them; the
        # market's shutdown() still stops it explicitly.
        in_main = threading.current_thread() is threading.main_thread()
        with self._add_lock:
            saved = self.cluster._shutdown_at_exit
            self.cluster._shutdown_at_exit = saved and in_main
            try:
                node = self.cluster.add_node(
                    num_cpus=cpus,
                    num_gpus=gpus,
                    object_store_memory=self._object_store,
                    labels={MARKET_LABEL: market, **({} if speed is None else {SPEED_LABEL: _fmt_speed(speed)})},
                )
            finally:
                self.cluster._shutdown_at_exit = saved
        sim = SimNode(name, market, speed or 0.0, cpus, node)
        self.nodes[sim.node_id] = sim
        self.log.append((time.time(), "add", sim.node_id))
        return sim

    def refill(self, spot: dict[str, float], *, cpus: float = 2, timeout_s: float = 90.0) -> None:
        """Add back the spot nodes of ``spot`` ({name: speed}) that are gone, then wait until
        the head and every one of them is usable with all its CPUs free (the starting shape
        of the next test or benchmark round); TimeoutError after ``timeout_s``."""
        from raylane.cluster import ClusterView

        present = {n.name for n in self.nodes.values()}
        for name, speed in spot.items():
            if name not in present:
                self.add_node("spot", speed=speed, cpus=cpus, name=name)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            view = ClusterView.from_ray()
            if len(view.usable) == 1 + len(spot) and all(n.available.get("CPU", 0) == n.cpus for n in view.usable):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the cluster did not come back to its starting shape (head and {', '.join(spot)}) in {timeout_s:g} s")

    def spot_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.market == "spot"]

    def preempt(self, sim: SimNode, *, notice_s: float = 2.0, wait_dead_s: float = 30.0) -> None:
        """A spot loss with notice: drain with a deadline, wait the notice out, remove, wait until dead."""
        from raylane import raystate

        raystate.drain_node(sim.node_id, notice_s, reason="preemption", message=f"spot preemption of {sim.name}")
        self.log.append((time.time(), "notice", sim.node_id))
        time.sleep(notice_s)
        self.remove(sim, wait_dead_s=wait_dead_s)

    def remove(self, sim: SimNode, *, wait_dead_s: float = 30.0) -> None:
        """A spot loss without notice: kill the node's processes and wait until Ray marks it dead."""
        self.nodes.pop(sim.node_id, None)
        self.cluster.remove_node(sim.node, allow_graceful=False)
        self.log.append((time.time(), "removed", sim.node_id))
        wait_dead(sim.node_id, timeout_s=wait_dead_s)
        self.log.append((time.time(), "dead", sim.node_id))

    def play(self, schedule: list[MarketEvent], *, seed: int = 0, on_event: Callable[[MarketEvent, SimNode], None] | None = None) -> threading.Thread:
        """Run ``schedule`` in a background thread (times relative to now); returns the thread."""
        rng = random.Random(seed)
        start = time.monotonic()

        def run() -> None:
            for ev in schedule:
                time.sleep(max(0.0, start + ev.at - time.monotonic()))
                victims = sorted(self.spot_nodes(), key=lambda n: n.name)
                if not victims:
                    continue
                victim = rng.choice(victims)
                if on_event:
                    on_event(ev, victim)
                if ev.action == "preempt":
                    self.preempt(victim, notice_s=ev.notice_s)
                else:
                    self.remove(victim)
                if ev.replace_after_s is not None:
                    time.sleep(ev.replace_after_s)
                    self.add_node("spot", speed=victim.speed or None, cpus=victim.cpus)

        thread = threading.Thread(target=run, name="spot-market", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        self.cluster.shutdown()


def wait_dead(node_id: str, *, timeout_s: float = 30.0) -> None:
    """Block until Ray's node table marks ``node_id`` dead (its actors may answer until then)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n in ray.nodes():
            if n["NodeID"] == node_id and not n["Alive"]:
                return
        time.sleep(0.1)
    raise TimeoutError(f"node {node_id[:8]} was not marked dead within {timeout_s} s; check the health-check settings")


def _fmt_speed(speed: float) -> str:
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return f"{speed:g}"
