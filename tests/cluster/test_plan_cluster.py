"""The plan is where the actors start: the driver sizes every group from its plan and starts
the first actors on the nodes the plan chose, so the ``plan`` event is the placement a user
reads, on the simulated spot cluster (an on-demand head and two spot nodes of different speed)."""

from __future__ import annotations

from collections import Counter

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_the_plan_event_is_where_every_actor_started(spot_cluster, tmp_path):
    # Three workers of one CPU on a cluster with room for five: the plan holds exactly the
    # three asked for (not the role's max_workers), spread over the spot nodes by speed.
    conf = PPOConfig(workers=3, worker_cpus=1.0, max_workers=8, total_env_steps=10_000_000)
    conf.driver = DriverConfig(run_name="planned", runs_dir=str(tmp_path), max_steps=2, progress=False, tensorboard=False, autoscale=False)
    workload = PPOWorkload(conf)
    started: dict[str, Counter] = {}

    def look() -> None:
        started.update({role: Counter(g.status().nodes) for role, g in (("learner", workload.learner), ("rollout_worker", workload.workers))})

    run = drive(workload, conf.driver, at={0: look})
    assert run.summary["state"] == "finished", run.summary
    plan = next(e for e in run.events if e["event"] == "plan")["assignments"]
    planned = {role: Counter(a["node_id"] for a in plan if a["role"] == role) for role in ("learner", "rollout_worker")}
    assert sum(planned["rollout_worker"].values()) == 3 and sum(planned["learner"].values()) == 1, plan
    assert started == planned, (started, planned)
    markets = {a["role"]: a["market"] for a in plan}
    assert markets == {"learner": "on-demand", "rollout_worker": "spot"}
