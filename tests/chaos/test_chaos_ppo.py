"""Chaos for PPO on the simulated spot cluster: rollout workers on spot lose their nodes
on a seeded schedule (notice, hard removal, all spot gone and back) while the learner on
the on-demand head trains; the job still solves CartPole."""

from __future__ import annotations

import time

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_ppo_solves_cartpole_through_a_seeded_spot_schedule(spot_cluster, tmp_path):
    market = spot_cluster
    conf = PPOConfig(workers=2, worker_cpus=1.0, total_env_steps=400_000)
    conf.driver = DriverConfig(run_name="ppo-chaos", runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False, checkpoint_every_steps=10)
    workload = PPOWorkload(conf)
    log: list[str] = []

    def schedule(steps):
        steps.wait(8)
        victim = sorted(market.spot_nodes(), key=lambda n: n.name)[0]
        log.append(f"notice {victim.name}")
        market.preempt(victim, notice_s=6.0)  # longer than a step: the driver sees the notice at a step boundary
        market.add_node("spot", speed=victim.speed, cpus=2, name=victim.name)
        steps.wait(len(steps) + 10)
        victim = sorted(market.spot_nodes(), key=lambda n: n.name)[-1]
        log.append(f"remove {victim.name}")
        market.remove(victim)
        steps.wait(len(steps) + 5)
        for victim in list(market.spot_nodes()):
            log.append(f"remove {victim.name}")
            market.remove(victim)
        time.sleep(4.0)
        for name, speed in (("spot-slow", 1.0), ("spot-fast", 2.0)):
            if name not in {n.name for n in market.spot_nodes()}:
                market.add_node("spot", speed=speed, cpus=2, name=name)
        log.append("spot back")

    # hold: the run does not end before the schedule has played out in full
    run = drive(workload, conf.driver, during=schedule, hold=True, join_s=120)
    summary, events = run.summary, run.events
    assert log[-1] == "spot back" and summary["state"] == "finished", (log, summary)
    rows = read_jsonl(tmp_path / "ppo-chaos" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # no step applied twice
    assert summary["failures_recovered"] == 0  # the learner's state never lived on spot
    assert summary["final_metrics"]["return_mean"] >= 475.0  # the fault-free result: solved
    assert any(e["event"] == "NodeLeaving" for e in events) and sum(e["event"] == "NodeLost" for e in events) >= 3
