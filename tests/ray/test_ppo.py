"""PPO end to end on one local Ray: solving CartPole, continuous control, and faults."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import ray

from raylane.checkpoint import CheckpointStore
from raylane.driver import Driver, DriverConfig, NonFiniteError
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl

from harness import drive, watch_restores  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def make(tmp_path, name, **kw) -> tuple[PPOWorkload, Driver]:
    driver_kw = kw.pop("driver", {})
    conf = PPOConfig(**kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=100_000, progress=False, tensorboard=False, **driver_kw)
    workload = PPOWorkload(conf)
    return workload, Driver(workload, conf.driver)


def test_ppo_solves_cartpole_within_a_step_budget(ray_local, tmp_path):
    workload, driver = make(tmp_path, "solve", total_env_steps=150_000)
    summary = driver.run()
    assert summary["state"] == "finished"
    final = summary["final_metrics"]
    assert final["return_mean"] >= 475.0, final
    assert final["env_steps"] < 150_000  # stopped on the target, not the budget
    assert (tmp_path / "solve" / "return_vs_steps.png").stat().st_size > 10_000
    seeds = [e["seeds"] for e in read_jsonl(tmp_path / "solve" / "events.jsonl") if e["event"] == "worker_seeds"]
    flat = [s for group in seeds for s in group]
    assert len(seeds) == 2 and len(set(flat)) == len(flat) == 16  # every env copy seeded differently


def test_ppo_solves_cartpole_on_the_envpool_backend(ray_local, tmp_path):
    """envpool's C++ CartPole, its episodes reset in the step that ended them by raylane's
    adapter: the same learning as gymnasium's backends (a wrong bootstrap would stall it)."""
    pytest.importorskip("envpool")  # in the test extra
    workload, driver = make(tmp_path, "envpool", vector="envpool", total_env_steps=150_000)
    summary = driver.run()
    assert summary["state"] == "finished"
    final = summary["final_metrics"]
    assert final["return_mean"] >= 475.0 and final["env_steps"] < 150_000, final


@pytest.mark.slow  # long (30-45 s); the default run keeps this job's other fault tests
def test_pendulum_trains_and_its_return_improves(ray_local, tmp_path):
    workload, driver = make(
        tmp_path, "pendulum", env_id="Pendulum-v1", total_env_steps=80_000, target_return=None, normalize_obs=True,
        gamma=0.9, gae_lambda=0.95, epochs=10, rollout_steps=256, minibatches=32, reward_scale=0.1, lr=3e-4, anneal=False, envs_per_worker=4,
    )
    summary = driver.run()
    assert summary["state"] == "finished"
    rows = read_jsonl(tmp_path / "pendulum" / "metrics.jsonl")
    early, late = rows[2]["return_mean"], rows[-1]["return_mean"]
    assert late > early + 200, (early, late)


def test_a_rollout_worker_killed_mid_iteration_costs_only_its_samples(ray_local, tmp_path):
    workload, driver = make(tmp_path, "workerkill", rollout_steps=800, total_env_steps=300_000, target_return=None, sample_timeout_s=60)

    def kill(steps):
        steps.wait(4)
        time.sleep(0.15)  # inside iteration 4's sampling
        pid = workload.workers.call_all("info", timeout_s=30)[0]["pid"]
        os.kill(pid, signal.SIGKILL)

    summary = drive(workload, driver, during=kill, join_s=30).summary
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0
    rows = read_jsonl(tmp_path / "workerkill" / "metrics.jsonl")
    workers = [r["workers"] for r in rows]
    assert 1 in workers[3:6], workers  # the iteration with the kill went on with the survivor
    assert workers[-1] == 2, workers  # the replacement joined
    assert max(r["sample_s"] for r in rows) < 10  # no stall waiting for the dead worker
    assert rows[-1]["env_steps"] >= 300_000


def test_every_rollout_worker_killed_mid_iteration_is_sampled_again_without_a_rollback(ray_local, tmp_path):
    workload, driver = make(tmp_path, "allkill", rollout_steps=800, total_env_steps=120_000, target_return=None, sample_timeout_s=60)
    original = workload._submit_samples
    submissions, killed = [], []

    def submit_then_kill(timeout_s):
        # Both workers are killed right after the fifth submission hands each of them a call:
        # the two calls are lost together, so they are gathered (and found lost) in one step
        # by construction, whatever the machine's speed. A call is 800 steps of 8 envs, far
        # longer than the kill that follows its dispatch. Before the fifth submission the
        # previous calls have all been gathered, so the workers are idle and answer at once.
        pids = [info["pid"] for info in workload.workers.call_all("info", timeout_s=30)] if len(submissions) == 4 else []
        tickets = original(timeout_s)
        submissions.append(tickets)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return tickets

    workload._submit_samples = submit_then_kill
    summary = driver.run()
    assert len(killed) == 2 and len(submissions[4]) == 2
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0  # no rollback to the checkpoint
    rows = read_jsonl(tmp_path / "allkill" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    hit = [r for r in rows if r["lost_batches"] > 0]
    assert hit and hit[0]["workers"] >= 1 and hit[0]["lost_batches"] >= 2, [(r["step"], r["workers"], r["lost_batches"]) for r in rows]
    assert rows[-1]["env_steps"] >= 120_000
    evictions = [e for e in read_jsonl(tmp_path / "allkill" / "events.jsonl") if e["event"] == "eviction"]
    assert len(evictions) == 2 and {e["role"] for e in evictions} == {"rollout_worker"}, evictions  # each death is on record
    assert all(e["node"] and e["actor"] and "died" in e["reason"] for e in evictions), evictions


def _kill_learner(workload) -> ray.actor.ActorHandle:
    learner = workload.learner.handles()[0]
    os.kill(ray.get(learner.info.remote(), timeout=30)["pid"], signal.SIGKILL)
    return learner


@pytest.mark.parametrize("when", ["in_a_step", "between_steps"])
def test_a_killed_learner_is_replaced_and_resumes_from_the_last_checkpoint(ray_local, tmp_path, when):
    """Killed while a step runs, or idle between two steps (the driver has not called it
    since): either way the replacement must be loaded from the checkpoint, never trained
    on from scratch as if nothing happened."""
    workload, driver = make(tmp_path, "learnerkill", total_env_steps=40_000, target_return=None, driver={"checkpoint_every_steps": 5})

    def kill(steps):
        steps.wait(13, poll_s=0.01)
        _kill_learner(workload)

    def kill_idle():
        learner = _kill_learner(workload)
        with pytest.raises(ray.exceptions.RayActorError):  # dead before step 13 calls it
            ray.get(learner.info.remote(), timeout=30)

    restored = watch_restores(workload)
    if when == "in_a_step":
        run = drive(workload, driver, during=kill, join_s=30)
    else:
        run = drive(workload, driver, at={13: kill_idle})
    summary, events, steps = run.summary, run.events, run.steps
    assert summary["state"] == "finished" and summary["failures_recovered"] == 1
    assert restored == [True], restored  # the replacement holds the checkpoint, not fresh weights
    failure = next(e for e in events if e["event"] == "failure")
    ckpts_before = [e["step"] for e in events[: events.index(failure)] if e["event"] == "checkpoint"]
    resumed = next(e for e in events[events.index(failure):] if e["event"] == "state" and e["state"] == "running")
    # the newest committed checkpoint: one of every 5 steps, the one in flight at the kill perhaps not
    assert resumed["step"] == ckpts_before[-1] and 0 <= failure["step"] - ckpts_before[-1] <= 6, (failure, ckpts_before)
    # the steps after the reload repeat from the checkpoint on (the kill may land in a step
    # call or in the snapshot at the boundary after it)
    last, went_on = steps.rollback()
    assert went_on == ckpts_before[-1] and last in (failure["step"] - 1, failure["step"]), (list(steps), failure)


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_good_checkpoint(ray_local, tmp_path):
    workload, driver = make(tmp_path, "nan", lr=1e30, anneal=False, driver={"checkpoint_every_steps": 1})
    with pytest.raises(NonFiniteError, match="metric 'loss' is nan at step 1"):
        driver.run()
    step, state = CheckpointStore(str(tmp_path / "nan" / "checkpoints")).load_whole()
    assert step == 0
    assert all(np.isfinite(v.numpy()).all() for v in state["workload"]["learner"]["params"].values())
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["state"] == "failed"
