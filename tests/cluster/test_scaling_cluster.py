"""Scaling a running job's pool from the command line on the simulated spot cluster:
PPO's rollout workers go 2 -> 4 -> (impossible 16) -> 1 while it trains."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback

import pytest

from raylane import raystate
from raylane.driver import DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(500)]

RUN = "ppo-scaled"


def cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raylane", *args, "--address", address], capture_output=True, text=True, timeout=240)


def test_ppo_pool_scaled_from_the_command_line_while_it_trains(spot_cluster, tmp_path):
    # One CPU per worker: the cluster (head 2, two spot nodes of 2) holds the learner and 5 workers.
    conf = PPOConfig(workers=2, worker_cpus=1.0, max_workers=16, total_env_steps=400_000)
    conf.driver = DriverConfig(run_name=RUN, runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False)
    workload = PPOWorkload(conf)
    seen: dict[str, object] = {}
    addr = spot_cluster.address

    def session(steps):
        try:
            steps.wait(3, poll_s=0.1)
            seen["pools0"] = cli(addr, "pools", RUN, "--json")
            seen["up"] = cli(addr, "scale", RUN, "rollout_worker", "4")
            seen["pools4"] = cli(addr, "pools", RUN, "--json")
            seen["table"] = cli(addr, "pools", RUN)
            seen["unknown_run"] = cli(addr, "scale", "no-such-run", "rollout_worker", "2")
            seen["unknown_role"] = cli(addr, "scale", RUN, "sampler", "2")
            seen["too_small"] = cli(addr, "scale", RUN, "rollout_worker", "0")
            seen["too_big"] = cli(addr, "scale", RUN, "rollout_worker", "17")
            seen["fixed"] = cli(addr, "scale", RUN, "learner", "2")
            seen["impossible"] = cli(addr, "scale", RUN, "rollout_worker", "16")
            seen["requested"] = raystate.requested_resources()
            seen["down"] = cli(addr, "scale", RUN, "rollout_worker", "1")
            seen["pools1"] = cli(addr, "pools", RUN, "--json")
            seen["steps_at_end"] = len(steps)
        except BaseException:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = traceback.format_exc()

    run = drive(workload, conf.driver, during=session, hold=True, join_s=60)  # hold the run until the session is over
    summary, events = run.summary, run.events
    assert "error" not in seen, seen["error"]
    for key in ("pools0", "up", "pools4", "table", "down", "pools1"):
        assert seen[key].returncode == 0, (key, seen[key].stdout, seen[key].stderr)

    def pool(key: str) -> dict:
        return json.loads(seen[key].stdout)["pools"]["rollout_worker"]

    assert pool("pools0")["live"] == 2 and pool("pools0")["markets"] == {"spot": 2}
    assert pool("pools4")["live"] == 4 and "4 live" in seen["up"].stdout
    assert "rollout_worker" in seen["table"].stdout and "learner" in seen["table"].stdout
    assert pool("pools1")["live"] == 1 and pool("pools1")["target"] == 1
    # bad input: exit 2 and what would be valid
    assert seen["unknown_run"].returncode == 2 and "unknown run 'no-such-run'" in seen["unknown_run"].stderr and RUN in seen["unknown_run"].stderr
    assert seen["unknown_role"].returncode == 2 and "unknown role 'sampler'; this run's pools are: learner, rollout_worker" in seen["unknown_role"].stderr
    assert seen["too_small"].returncode == 2 and "outside its range 1..16" in seen["too_small"].stderr
    assert seen["too_big"].returncode == 2 and "17 actors" in seen["too_big"].stderr
    assert seen["fixed"].returncode == 2 and "fixed size of 1" in seen["fixed"].stderr
    # more than the cluster holds: says which resources are missing, and that no autoscaler will add them
    impossible = " ".join(seen["impossible"].stderr.split())
    assert seen["impossible"].returncode == 3, seen["impossible"]
    assert "no room for" in impossible and "{CPU=1} each" in impossible and "no autoscaler" in impossible, impossible
    # ... and still asked Ray's autoscaler for the missing room (a no-op without one)
    assert seen["requested"] and all(b == {"CPU": 1.0} for b in seen["requested"]) and len(seen["requested"]) >= 10, seen["requested"]

    assert summary["state"] == "finished", summary
    rows = read_jsonl(tmp_path / RUN / "metrics.jsonl")
    assert all(r["lost_batches"] == 0 for r in rows)  # every step's batch was complete through every resize
    workers = [r["workers"] for r in rows]
    assert 2 in workers and 4 in workers and workers[-1] == 1, workers
    assert summary["final_metrics"]["return_mean"] >= 475.0  # as good as an unscaled run
    scales = [(e["target"], e["reason"]) for e in events if e["event"] == "scale" and e["role"] == "rollout_worker"]
    assert (4, "raylane scale") in scales and (16, "raylane scale") in scales and scales[-1][0] in (1,), scales
