"""The user-written workloads in examples/, run the ways a user runs them: through the public
API (``raylane.api``) and, as a file of their own, through ``raylane run path.py:NAME``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from raylane.api import job, job_config, run
from raylane.checkpoint import CheckpointStore
from raylane.runlog import read_jsonl

from harness import drive, ray_in_folder  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DP = f"{ROOT / 'examples' / 'dp_classifier.py'}:JOB"


@pytest.fixture(scope="module")
def ray_at_root():
    """Ray started from the folder that holds examples/, as a user runs raylane from their
    project: the driver's working folder is on every worker's import path."""
    with ray_in_folder(ROOT, num_cpus=4) as root:
        yield root


def settings(tmp_path, name: str, steps: int) -> list[str]:
    return [f"driver.runs_dir={tmp_path}", f"driver.run_name={name}", f"driver.max_steps={steps}", "driver.tensorboard=false",
            "driver.checkpoint_every_steps=4", "driver.progress=false", "workers=3"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    step, state = CheckpointStore(str(run_dir / "checkpoints")).load()
    return state["workload"]["model"]


def test_the_data_parallel_example_loses_a_worker_and_ends_with_the_weights_of_a_calm_run(ray_at_root, tmp_path):
    calm = run(DP, overrides=settings(tmp_path, "calm", 16))
    assert calm["state"] == "finished" and calm["steps"] == 16 and calm["final_metrics"]["accuracy"] > 0.8, calm

    spec = job(DP)
    conf = job_config(spec, overrides=settings(tmp_path, "killed", 16))
    workload = spec.build(conf)
    killed = []

    def kill_a_worker():  # inside step 6, before its gradients are asked for
        victim = workload.pool.actors()[0]
        killed.append(victim)
        ray.kill(victim, no_restart=True)

    result = drive(workload, conf.driver, at={6: kill_a_worker})
    assert killed and result.summary["state"] == "finished" and result.summary["steps"] == 16
    assert result.summary["failures_recovered"] == 0  # the pool ran the lost shards again: no step failed
    evictions = [e for e in result.events if e["event"] == "eviction"]
    assert [e["role"] for e in evictions] == ["gradient_worker"], evictions
    want, got = final_model(tmp_path / "calm"), final_model(result.run_dir)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)  # same shards, same order: same sums


def test_a_bad_config_of_a_users_job_names_the_key(ray_at_root, tmp_path):
    with pytest.raises(ValueError, match="workers: must be >= 1, got 0"):
        run(DP, overrides=[*settings(tmp_path, "bad", 2), "workers=0"])
    with pytest.raises(ValueError, match="unknown key 'wokers' for DPConfig; did you mean 'workers'"):
        run(DP, overrides=[*settings(tmp_path, "bad", 2), "wokers=2"])


def test_raylane_run_takes_a_file_and_its_workers_import_it_by_value(tmp_path):
    """A fresh process with an embedded Ray: the workers have never seen examples/ on their path."""
    env = {**os.environ, "PYTHONPATH": ""}
    cmd = [sys.executable, "-m", "raylane", "run", os.path.relpath(DP.rsplit(":", 1)[0], tmp_path) + ":JOB", "--no-progress",
           "--set", f"driver.runs_dir={tmp_path / 'runs'}", "--set", "driver.max_steps=3", "--set", "driver.tensorboard=false"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "dp_classifier: finished after 3 steps" in out.stdout, out.stdout


def installed_raylane() -> str:
    """The console script ``pip install`` made (not ``python -m raylane``): its sys.path[0]
    is its bin folder, not the folder it is run from."""
    script = Path(sys.executable).parent / "raylane"
    found = str(script) if script.exists() else shutil.which("raylane")
    assert found, "no raylane console script next to this Python or on PATH"
    return found


@pytest.mark.timeout(120)
def test_the_installed_raylane_command_trains_the_readmes_env_of_a_users_module(tmp_path):
    """README: `raylane run ppo --set env_id=examples.gridworld:Gridworld-v0` from the folder
    holding examples/. The driver imports the module from its working folder, and the rollout
    workers (other processes) import it too: both made the user's env."""
    env = {**os.environ, "PYTHONPATH": ""}
    cmd = [installed_raylane(), "run", "ppo", "--set", "env_id=examples.gridworld:Gridworld-v0", "--no-progress",
           "--set", "workers=1", "--set", "envs_per_worker=2", "--set", "rollout_steps=32", "--set", "plot=false",
           "--set", f"driver.runs_dir={tmp_path / 'runs'}", "--set", "driver.run_name=grid", "--set", "driver.max_steps=2",
           "--set", "driver.tensorboard=false", "--set", "driver.progress=false"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "grid" / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps"] == 2, summary
    assert summary["final_metrics"]["env_steps"] == 2 * 2 * 32, summary["final_metrics"]  # the worker stepped the env
    seeds = [e for e in read_jsonl(tmp_path / "runs" / "grid" / "events.jsonl") if e["event"] == "worker_seeds"]
    assert seeds and all(e["env"] == "examples.gridworld:Gridworld-v0" for e in seeds)


def test_a_users_env_reaches_a_process_that_cannot_import_its_module(tmp_path, monkeypatch):
    """A rollout worker on another node has no examples/ to import: the recipe the driver hands
    the workers carries the env's class by value, as a job file's classes travel."""
    from ray import cloudpickle

    from raylane.jobs.ppo import PPOConfig
    from raylane.jobs.rl_env import resolve

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    conf = PPOConfig(env_id="examples.gridworld:Gridworld-v0", env_kwargs={"size": 3}, target_return=None, plot=False)
    recipe, _, spec = resolve(conf)
    assert recipe.env_id == "examples.gridworld:Gridworld-v0" and spec.obs_dim == 2 and recipe.spec is not None
    probe = ("import sys; from ray import cloudpickle; from raylane.actors.envs import build; "
             "env = build(cloudpickle.loads(sys.stdin.buffer.read())); env.reset(seed=0); "
             "print(type(env.unwrapped).__name__, env.unwrapped.size, 'examples.gridworld' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], input=cloudpickle.dumps(recipe), cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ""}, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().split() == ["Gridworld", "3", "False"]  # made from the class sent, not imported by name


def test_ppo_trains_the_examples_own_gymnasium_env_named_by_module_and_id(ray_at_root, tmp_path):
    summary = run("ppo", overrides=[
        "env_id=examples.gridworld:Gridworld-v0", "workers=2", "envs_per_worker=4", "rollout_steps=128", "total_env_steps=60000",
        "target_return=0.85", f"driver.runs_dir={tmp_path}", "driver.run_name=grid", "driver.tensorboard=false", "driver.progress=false", "plot=false",
    ])
    assert summary["state"] == "finished", summary
    assert summary["final_metrics"]["return_mean"] >= 0.85, summary["final_metrics"]  # the best return on 5 x 5 is 0.93
    seeds = [e for e in read_jsonl(tmp_path / "grid" / "events.jsonl") if e["event"] == "worker_seeds"]
    assert seeds and all(e["env"] == "examples.gridworld:Gridworld-v0" for e in seeds)  # the workers made the user's env
