"""Chaos for PPO on the simulated spot cluster: rollout workers on spot lose their nodes
on a seeded schedule (notice, hard removal, all spot gone and back) while the learner on
the on-demand head trains; the job still solves CartPole."""

from __future__ import annotations

import threading
import time

import pytest

from raylane.driver import Driver, DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_ppo_solves_cartpole_through_a_seeded_spot_schedule(spot_cluster, tmp_path):
    market = spot_cluster
    conf = PPOConfig(workers=2, worker_cpus=1.0, total_env_steps=400_000)
    conf.driver = DriverConfig(run_name="ppo-chaos", runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False, checkpoint_every_steps=10)
    workload = PPOWorkload(conf)
    steps: list[int] = []
    original_step, original_done = workload.step, workload.done
    workload.step = lambda i: (steps.append(i), original_step(i))[1]
    over = threading.Event()
    workload.done = lambda i, m: original_done(i, m) and over.is_set()  # the schedule plays out in full
    log: list[str] = []

    def at_step(n):
        while len(steps) < n:
            time.sleep(0.02)

    def schedule():
        try:
            at_step(8)
            victim = sorted(market.spot_nodes(), key=lambda n: n.name)[0]
            log.append(f"notice {victim.name}")
            market.preempt(victim, notice_s=2.0)
            market.add_node("spot", speed=victim.speed, cpus=2, name=victim.name)
            at_step(len(steps) + 10)
            victim = sorted(market.spot_nodes(), key=lambda n: n.name)[-1]
            log.append(f"remove {victim.name}")
            market.remove(victim)
            at_step(len(steps) + 5)
            for victim in list(market.spot_nodes()):
                log.append(f"remove {victim.name}")
                market.remove(victim)
            time.sleep(4.0)
            for name, speed in (("spot-slow", 1.0), ("spot-fast", 2.0)):
                if name not in {n.name for n in market.spot_nodes()}:
                    market.add_node("spot", speed=speed, cpus=2, name=name)
            log.append("spot back")
        finally:
            over.set()

    t = threading.Thread(target=schedule, daemon=True)
    t.start()
    summary = Driver(workload, conf.driver).run()
    t.join(timeout=120)
    assert log[-1] == "spot back" and summary["state"] == "finished", (log, summary)
    rows = read_jsonl(tmp_path / "ppo-chaos" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # no step applied twice
    assert summary["failures_recovered"] == 0  # the learner's state never lived on spot
    assert summary["final_metrics"]["return_mean"] >= 475.0  # the fault-free result: solved
    events = read_jsonl(tmp_path / "ppo-chaos" / "events.jsonl")
    assert any(e["event"] == "NodeLeaving" for e in events) and sum(e["event"] == "NodeLost" for e in events) >= 3
