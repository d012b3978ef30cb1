"""The control plane on a simulated heterogeneous cluster: an on-demand head and two
spot nodes of speeds 1 and 2 (the `spot_cluster` fixture), real raylets throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import ray

from raylane import raystate
from raylane.actors.grad_worker import rows
from raylane.cluster import ClusterView
from raylane.driver import DriverConfig
from raylane.jobs.linreg import LinRegConfig, LinRegWorkload
from raylane.placement import RoleSpec, plan
from raylane.ray_options import ray_options
from raylane.group import TaskPool
from raylane.preemption import NodeJoined, NodeLeaving, NodeLost, PreemptionMonitor

from harness import drive  # tests/harness.py
from market_helpers import wait_all_free, by_name  # tests/market_helpers.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@ray.remote
class Where:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def work(self, x: int, delay: float) -> tuple[int, str]:
        time.sleep(delay)
        return x, ray.get_runtime_context().get_node_id()


def test_cluster_view_reads_markets_and_speeds(spot_cluster):
    view = ClusterView.from_ray()
    assert len(view.alive) == 3
    head = view.node(spot_cluster.head_node_id)
    assert head.market == "on-demand" and head.is_head
    slow, fast = by_name(spot_cluster, "spot-slow"), by_name(spot_cluster, "spot-fast")
    assert view.node(slow.node_id).market == "spot" and view.node(slow.node_id).speed == 1.0
    assert view.node(fast.node_id).speed == 2.0 and view.node(fast.node_id).speed_source == "label"
    assert view.node(fast.node_id).cpus == 2.0


def test_unlabeled_node_speed_is_measured_once_and_cached(spot_cluster):
    extra = spot_cluster.add_node("on-demand", speed=None, cpus=1, name="unlabeled")
    try:
        view = ClusterView.from_ray()
        n = view.node(extra.node_id)
        assert n.speed_source == "measured" and 0.01 < n.speed < 100
        assert raystate.kv_get(f"speed:{extra.node_id}") == n.speed
        again = ClusterView.from_ray()
        assert again.node(extra.node_id).speed == n.speed
    finally:
        spot_cluster.remove(extra)


def test_cli_prints_the_cluster_as_json(spot_cluster):
    out = subprocess.run(
        [sys.executable, "-m", "raylane", "cluster", "--address", spot_cluster.address, "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    alive = [n for n in data["nodes"] if n["alive"]]
    assert sorted(n["market"] for n in alive) == ["on-demand", "spot", "spot"]
    assert sorted(n["speed"] for n in alive if n["market"] == "spot") == [1.0, 2.0]


def test_plan_places_stateful_on_demand_and_stateless_on_spot_by_speed(spot_cluster):
    wait_all_free()
    roles = [RoleSpec("sampler", {"CPU": 0.5}, count=3), RoleSpec("learner", {"CPU": 1.0}, count=1, stateful=True)]
    p = plan(roles, ClusterView.from_ray())
    slow, fast = by_name(spot_cluster, "spot-slow"), by_name(spot_cluster, "spot-fast")
    assert [a.node_id for a in p.for_role("learner")] == [spot_cluster.head_node_id]
    placed = [a.node_id for a in p.for_role("sampler")]
    assert placed.count(fast.node_id) == 2 and placed.count(slow.node_id) == 1
    actors = [Where.options(**ray_options(a)).remote() for a in p.assignments]
    try:
        where = ray.get([a.node.remote() for a in actors], timeout=60)
        assert where == [a.node_id for a in p.assignments]  # Ray put them where the plan said
    finally:
        for a in actors:
            ray.kill(a)


def test_pool_survives_spot_node_removal_and_recovers_its_size(spot_cluster):
    wait_all_free()
    role = RoleSpec("sampler", {"CPU": 1.0}, min_count=1, max_count=4)
    pool = TaskPool(role, Where, size=3, call_timeout_s=60)
    try:
        pool.wait_ready(timeout_s=60)
        assert set(pool.status().markets) == {"spot"}  # stateless prefers spot
        fast = by_name(spot_cluster, "spot-fast")
        assert pool.status().nodes.get(fast.node_id, 0) >= 1
        tickets = [pool.submit("work", i, 0.3) for i in range(24)]
        remover = threading.Timer(0.8, lambda: spot_cluster.remove(fast))
        remover.start()
        done = pool.gather(tickets, timeout_s=120)
        remover.join()
        assert sorted(done) == sorted(tickets)
        assert sorted(x for x, _ in done.values()) == list(range(24))
        pool.wait_ready(timeout_s=60)
        st = pool.status()
        assert st.live == 3 and fast.node_id not in st.nodes
        assert any(e.node_id == fast.node_id for e in st.evictions)
    finally:
        pool.shutdown()
        spot_cluster.add_node("spot", speed=2.0, cpus=2, name="spot-fast")


def test_preemption_monitor_sees_notice_loss_and_join(spot_cluster):
    monitor = PreemptionMonitor()
    victim = by_name(spot_cluster, "spot-slow")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    holder = Where.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(victim.node_id, soft=False)).remote()
    assert ray.get(holder.node.remote(), timeout=60) == victim.node_id  # a busy node stays draining until removed
    drained_at = time.time()
    raystate.drain_node(victim.node_id, 20.0, message="test notice")
    leaving, deadline = [], time.time() + 10
    while not leaving and time.time() < deadline:
        leaving = [e for e in monitor.poll() if isinstance(e, NodeLeaving)]
        time.sleep(0.1)
    assert [e.node_id for e in leaving] == [victim.node_id]
    assert abs(leaving[0].deadline - (drained_at + 20.0)) < 2.0, leaving[0]  # the notice's own deadline, however late it was seen
    assert ClusterView.from_ray().node(victim.node_id).draining
    t0 = time.monotonic()
    spot_cluster.remove(victim)
    detected = time.monotonic() - t0
    assert detected < 12.0, f"dead node noticed after {detected:.1f} s"  # Ray's default health checks take 15 s and more
    assert [e.node_id for e in monitor.poll() if isinstance(e, NodeLost)] == [victim.node_id]
    back = spot_cluster.add_node("spot", speed=1.0, cpus=2, name="spot-slow")
    assert [e.node_id for e in monitor.poll() if isinstance(e, NodeJoined)] == [back.node_id]
    ray.kill(holder)


def reference_weights(conf: LinRegConfig, steps: int) -> np.ndarray:
    """The same gradient descent in one process, shard by shard in the same order."""
    from raylane.actors.grad_worker import GradWorkerConfig

    wl = LinRegWorkload(conf)
    data = [rows(GradWorkerConfig(conf.seed, conf.features, conf.noise), a, b) for a, b in wl.shards]
    w = np.zeros(conf.features)
    for _ in range(steps):
        grad, n = np.zeros_like(w), 0
        for x, y in data:
            grad += x.T @ (x @ w - y)
            n += len(y)
        w = w - conf.lr * (2.0 / n) * grad
    return w


def test_driver_finishes_through_spot_preemptions_with_exact_result(spot_cluster, tmp_path):
    wait_all_free()
    conf = LinRegConfig(rows=200_000, workers=4, max_workers=6, lr=0.05)
    conf.driver = DriverConfig(run_name="spot", runs_dir=str(tmp_path), max_steps=80, checkpoint_every_steps=10, progress=False, tensorboard=False)
    workload = LinRegWorkload(conf)

    # The run is held at three steps until the market has done its part, so every event is
    # seen between the steps it is meant to fall between, however fast or slow the steps are.
    drained, slow_gone, node_back = threading.Event(), threading.Event(), threading.Event()

    def held(event: threading.Event, timeout_s: float):
        def hold():
            assert event.wait(timeout=timeout_s)
        return hold

    at = {12: held(drained, 60),  # the notice is out: the driver sees it after this step, inside the notice
          40: held(slow_gone, 90),  # spot-slow is gone and Ray knows it: its workers die during this step
          58: held(node_back, 90)}  # capacity is back, so the regrowth is observed

    def chaos(steps_seen):
        steps_seen.wait(12, poll_s=0.05)
        fast = by_name(spot_cluster, "spot-fast")
        notice = threading.Thread(target=spot_cluster.preempt, args=(fast,), kwargs={"notice_s": 5.0}, daemon=True)  # with notice
        notice.start()
        deadline = time.time() + 30
        while time.time() < deadline and not ClusterView.from_ray().node(fast.node_id).draining:
            time.sleep(0.05)
        drained.set()
        notice.join(timeout=60)
        steps_seen.wait(41, poll_s=0.05)
        spot_cluster.remove(by_name(spot_cluster, "spot-slow"))  # without notice
        slow_gone.set()
        steps_seen.wait(59, poll_s=0.05)
        spot_cluster.add_node("spot", speed=2.0, cpus=2, name="spot-fast")  # capacity comes back
        node_back.set()

    run = drive(workload, conf.driver, at=at, during=chaos, join_s=60)
    summary, events, steps_seen = run.summary, run.events, run.steps
    assert summary["state"] == "finished" and summary["steps"] == 80
    assert steps_seen == list(range(80))  # no step was repeated or skipped: the pool absorbed both losses
    _, state = __import__("raylane.checkpoint", fromlist=["CheckpointStore"]).CheckpointStore(str(tmp_path / "spot" / "checkpoints")).load()
    assert np.array_equal(state["workload"]["w"], reference_weights(conf, 80))
    kinds = [e["event"] for e in events]
    assert "NodeLeaving" in kinds and kinds.count("NodeLost") >= 2
    # With both spot nodes gone only the head's 2 CPUs remain: the pool shrank to 2 instead of waiting.
    assert any(e["event"] == "scale" and e["target"] == 2 for e in events), [e for e in events if e["event"] == "scale"]
    # ... and grew back to the 4 asked for once a node joined.
    assert any(e["event"] == "scale" and e["target"] == 4 for e in events)
    assert summary["final_metrics"]["workers"] == 4
    spot_cluster.add_node("spot", speed=1.0, cpus=2, name="spot-slow")
