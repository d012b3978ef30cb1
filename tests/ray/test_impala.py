"""``impala`` end to end on one local Ray: solving CartPole, a worker SIGKILLed while the
learner runs, a learner killed mid-step, and a driver killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from raylane.checkpoint import CheckpointStore
from raylane.driver import Driver, DriverConfig
from raylane.jobs.impala import ImpalaConfig, ImpalaWorkload
from raylane.runlog import read_jsonl

from harness import drive, watch_restores  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def make(tmp_path, name, **kw) -> tuple[ImpalaWorkload, Driver]:
    driver_kw = kw.pop("driver", {})
    conf = ImpalaConfig(**kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False, **driver_kw)
    workload = ImpalaWorkload(conf)
    return workload, Driver(workload, conf.driver)


def test_impala_solves_cartpole_within_a_step_budget(ray_local, tmp_path):
    workload, driver = make(tmp_path, "solve", total_env_steps=500_000)
    summary = driver.run()
    assert summary["state"] == "finished"
    final = summary["final_metrics"]
    assert final["return_mean"] >= 475.0, final
    assert final["env_steps"] < 500_000  # stopped on the target, not the budget
    rows = read_jsonl(tmp_path / "solve" / "metrics.jsonl")
    # every learned-from fragment was within the bound, and the bound held the lag down
    assert all(0 <= r["staleness_max"] <= 8 for r in rows)
    events = read_jsonl(tmp_path / "solve" / "events.jsonl")
    sampling = [e for e in events if e["event"] == "sampling"][-1]
    nodes = list(sampling["nodes"].values())
    assert len(nodes) == 1 and nodes[0]["speed"] == 1.0 and nodes[0]["market"] == "on-demand"
    assert nodes[0]["env_steps"] == final["env_steps"]
    assert sum(sampling["staleness"].values()) == 2 * 10 * len(rows)  # fragments learned from
    assert (tmp_path / "solve" / "return_vs_steps.png").stat().st_size > 10_000


def test_a_worker_sigkilled_mid_run_never_blocks_the_learner(ray_local, tmp_path):
    workload, driver = make(tmp_path, "workerkill", total_env_steps=400_000, target_return=None, fragment_length=200)
    killed = {}

    def kill(steps):
        steps.wait(5)
        time.sleep(0.1)  # inside step 5's updates: both workers hold fragment calls
        info = workload.workers.call_all("info", timeout_s=30)[0]
        killed["pid"], killed["step"] = info["pid"], len(steps)
        os.kill(info["pid"], signal.SIGKILL)

    summary = drive(workload, driver, during=kill, join_s=30).summary
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0  # no step failed, nothing rolled back
    rows = read_jsonl(tmp_path / "workerkill" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    workers = [r["workers"] for r in rows]
    assert rows[-1]["env_steps"] >= 400_000 and 1 in workers and workers[-1] == 2, workers  # went on with one; the replacement joined
    assert rows[-1]["lost_fragments"] >= 1  # the dead worker's calls, and nothing else
    # The learner went on with the survivor's fragments: no wait for a batch in any step
    # came near the dead worker's call timeout (60 s); each stayed within a few fragment
    # times (a fragment here is 200 steps of 8 envs; the bound allows for the replacement
    # starting up on the same 2 cores).
    for r in rows:
        assert r["learner_wait_max_s"] <= 3 * r["fragment_s_max"] + 1.0, (r["step"], r["learner_wait_max_s"], r["fragment_s_max"])
    evictions = [e for e in read_jsonl(tmp_path / "workerkill" / "events.jsonl") if e["event"] == "eviction"]
    assert [e["role"] for e in evictions] == ["rollout_worker"] and "died" in evictions[0]["reason"], evictions


def test_a_learner_killed_mid_step_is_replaced_and_resumes_from_the_last_checkpoint(ray_local, tmp_path):
    workload, driver = make(tmp_path, "learnerkill", total_env_steps=60_000, target_return=None, driver={"checkpoint_every_steps": 5})

    def kill(steps):
        steps.wait(8, poll_s=0.01)
        learner = workload.learner.handles()[0]
        os.kill(ray.get(learner.info.remote(), timeout=30)["pid"], signal.SIGKILL)

    restored = watch_restores(workload)
    run = drive(workload, driver, during=kill, join_s=30)
    summary, events, steps = run.summary, run.events, run.steps
    assert summary["state"] == "finished" and summary["failures_recovered"] == 1
    assert restored == [True], restored  # the replacement holds the checkpoint, not fresh weights
    failure = next(e for e in events if e["event"] == "failure")
    ckpts_before = [e["step"] for e in events[: events.index(failure)] if e["event"] == "checkpoint"]
    resumed = next(e for e in events[events.index(failure):] if e["event"] == "state" and e["state"] == "running")
    # the newest committed checkpoint: one of every 5 steps, the one in flight at the kill perhaps not
    assert resumed["step"] == ckpts_before[-1] and 0 <= failure["step"] - ckpts_before[-1] <= 6, (failure, ckpts_before)
    last, went_on = steps.rollback()  # in a step call or in the snapshot at the boundary after it
    assert went_on == ckpts_before[-1] and last in (failure["step"] - 1, failure["step"]), (list(steps), failure)
    _, saved = CheckpointStore(str(tmp_path / "learnerkill" / "checkpoints")).load_whole(ckpts_before[-1])
    assert saved["workload"]["learner"]["version"] == ckpts_before[-1] * 10  # updates_per_step learner versions per step


@pytest.mark.slow  # long (30-45 s); the default run keeps this job's other fault tests
def test_a_sigkilled_driver_resumes_at_the_last_checkpoint(tmp_path):
    args = ["--set", "total_env_steps=400000", "--set", "target_return=null", "--set", "driver.checkpoint_every_steps=5", "--set", "plot=false"]
    cmd = [sys.executable, "-m", "raylane", "run", "impala", "--run-name", "imp", "--set", f"driver.runs_dir={tmp_path}", "--no-progress", *args]
    victim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run_dir = tmp_path / "imp"
    deadline = time.time() + 150
    while time.time() < deadline and len(read_jsonl(run_dir / "metrics.jsonl")) < 11:
        assert victim.poll() is None, victim.stdout.read()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    last = CheckpointStore(str(run_dir / "checkpoints")).latest()
    assert last is not None and 10 <= last.step <= len(read_jsonl(run_dir / "metrics.jsonl"))
    _, saved = CheckpointStore(str(run_dir / "checkpoints")).load_whole(last.step)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == last.step and summary["state"] == "finished"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == last.step + 1]
    # the first step after the restart continues the checkpoint's counts, with its learner
    assert rows[-1]["env_steps"] > saved["workload"]["env_steps"]
    assert rows[-1]["episodes"] >= saved["workload"]["episodes"]
    assert summary["final_metrics"]["env_steps"] >= 400000
