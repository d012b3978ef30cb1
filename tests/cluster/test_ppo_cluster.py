"""PPO on the simulated spot cluster: the learner on the on-demand head, rollout workers
on spot nodes; a spot node is lost mid-run and comes back."""

from __future__ import annotations

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]


def test_ppo_reaches_the_target_through_a_spot_loss_and_the_pool_regrows(spot_cluster, tmp_path):
    # Each worker takes a whole spot node (2 CPUs), so a lost node cannot be refilled
    # until a node joins: the pool must shrink to 1 and grow back to 2.
    conf = PPOConfig(workers=2, worker_cpus=2.0, total_env_steps=250_000)
    conf.driver = DriverConfig(run_name="ppo-spot", runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False)
    workload = PPOWorkload(conf)
    removed = {}

    def chaos(iterations):
        iterations.wait(15, poll_s=0.05)
        nodes = workload.workers.status().nodes
        victim = next(n for n in spot_cluster.nodes.values() if n.node_id in nodes)
        removed["name"] = victim.name
        spot_cluster.remove(victim)  # no notice
        iterations.wait(len(iterations) + 15, poll_s=0.05)
        spot_cluster.add_node("spot", speed=victim.speed, cpus=2, name=victim.name)

    run = drive(workload, conf.driver, during=chaos, join_s=60)
    summary, events = run.summary, run.events
    assert summary["state"] == "finished", summary
    assert summary["final_metrics"]["return_mean"] >= 475.0
    plan = next(e for e in events if e["event"] == "plan")["assignments"]
    assert [a["market"] for a in plan if a["role"] == "learner"] == ["on-demand"]
    assert {a["market"] for a in plan if a["role"] == "rollout_worker"} == {"spot"}
    scales = [(e["role"], e["target"]) for e in events if e["event"] == "scale"]
    assert ("rollout_worker", 1) in scales and scales[-1] == ("rollout_worker", 2), scales
    workers = [r["workers"] for r in read_jsonl(tmp_path / "ppo-spot" / "metrics.jsonl")]
    assert 1 in workers and workers[-1] == 2
    assert "name" in removed
