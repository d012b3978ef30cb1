"""ppo's and impala's policy, and linreg's weights, out of a run and back in a process where
Ray never starts: ``raylane export`` of a short run, then ``raylane.api.load_model`` in a
subprocess. The loaded policy's logits and values on a fixed batch of observations are those
of the learner's weights in the checkpoint (its observation statistics applied as the
rollout workers applied them), and it steps CartPole greedily with the actions those weights
choose; linreg's loaded weights reproduce the run's weight_error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from raylane import api
from raylane.actors.grad_worker import GradWorkerConfig, rows, true_weights
from raylane.actors.policy import NumpyPolicy, RunningMeanStd
from raylane.checkpoint import CheckpointStore
from raylane.export import export_run
from raylane.jobs.rl_env import check_env
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_local")]

COMMON = ["driver.progress=false", "driver.tensorboard=false"]
RL = [*COMMON, "plot=false", "target_return=null", "workers=1", "max_workers=1", "envs_per_worker=4"]

# In a fresh process: the model loaded without Ray, its raw outputs on obs.npy, and three
# greedy CartPole episodes (each observation and the action it chose).
POLICY_SCRIPT = """
import json, sys, numpy as np, ray, torch, gymnasium as gym
from raylane.api import load_model
folder, work = sys.argv[1], sys.argv[2]
model = load_model(folder)
assert not ray.is_initialized() and not model.training and isinstance(model, torch.nn.Module)
with torch.no_grad():
    out, value = model(np.load(work + "/obs.npy"))
np.save(work + "/out.npy", out.numpy()); np.save(work + "/value.npy", value.numpy())
env, seen, chosen, returns = gym.make("CartPole-v1"), [], [], []
for seed in (0, 1, 2):
    obs, _ = env.reset(seed=seed)
    done, total = False, 0.0
    while not done:
        action = model.act(obs)
        seen.append(obs); chosen.append(int(action))
        obs, reward, terminated, truncated, _ = env.step(action)
        done, total = terminated or truncated, total + reward
    returns.append(total)
np.save(work + "/seen.npy", np.array(seen, np.float32)); np.save(work + "/chosen.npy", np.array(chosen))
assert not ray.is_initialized()
print(json.dumps({"returns": returns}))
"""


def trained(job: str, tmp_path, name: str, *overrides: str):
    """A short run through raylane.api.run (its config.json written), exported; (run folder, export folder, manifest)."""
    summary = api.run(job, overrides=[f"driver.runs_dir={tmp_path}", *overrides], run_name=name)
    assert summary["state"] == "finished", summary
    run_dir = tmp_path / name
    folder = export_run(run_dir)
    manifest = json.loads((folder / "export.json").read_text())
    assert manifest["job"] == job and manifest["step"] == summary["steps"], (manifest, summary)
    return run_dir, folder, manifest


def in_fresh_process(script: str, *args: str) -> str:
    """``script`` run by this Python with ``args``; its last line of output."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def checkpoint_policy(run_dir, activation: str) -> tuple[NumpyPolicy, RunningMeanStd, dict]:
    """The newest checkpoint's learner weights as the rollout workers act with them, its
    observation statistics, and its learner state."""
    _, state = CheckpointStore(str(run_dir / "checkpoints")).load_whole()
    learner = state["workload"]["learner"]
    spec = check_env("CartPole-v1")
    params = {k: np.asarray(v) for k, v in learner["params"].items()}
    rms = RunningMeanStd(spec.obs_dim)
    rms.load(learner["obs_rms"])
    return NumpyPolicy(spec, params, np.random.default_rng(0), activation), rms, learner


def check_policy_reloads(tmp_path, run_dir, folder, activation: str, normalize: bool) -> None:
    """The exported policy, loaded in a fresh process, computes what the checkpoint's weights compute."""
    worker, rms, learner = checkpoint_policy(run_dir, activation)
    obs = np.random.default_rng(7).normal(0.0, [1.0, 2.0, 0.1, 1.5], size=(256, 4)).astype(np.float32)
    np.save(tmp_path / "obs.npy", obs)
    got = json.loads(in_fresh_process(POLICY_SCRIPT, folder, tmp_path))
    fed = rms.normalize(obs) if normalize else obs  # what the workers feed the network
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), worker._mlp(fed, worker.pi), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "value.npy"), worker.value(fed), rtol=1e-5, atol=1e-5)
    seen = np.load(tmp_path / "seen.npy")
    seen_fed = rms.normalize(seen) if normalize else seen
    want = worker._mlp(seen_fed, worker.pi).argmax(-1)  # the greedy action of the checkpoint's weights
    assert len(seen) == sum(got["returns"]) and np.array_equal(np.load(tmp_path / "chosen.npy"), want)
    if normalize:
        assert np.abs(rms.mean).max() > 0 and learner["model"]["normalize_obs"]


def test_ppo_exports_its_policy_with_observation_statistics_and_loads_without_ray(tmp_path):
    run_dir, folder, manifest = trained("ppo", tmp_path, "ppo", *RL, "rollout_steps=64", "epochs=2", "normalize_obs=true", "driver.max_steps=4")
    assert set(manifest["files"]) == {"policy.pt"}
    model = manifest["model"]
    assert model["spec"] == {"obs_dim": 4, "discrete": True, "act_dim": 2, "act_low": [], "act_high": []}
    assert model["net"] == {"hidden": [64, 64], "activation": "tanh"} and model["normalize_obs"] and model["env_id"] == "CartPole-v1"
    assert model["version"] == 4  # one learner update per step
    check_policy_reloads(tmp_path, run_dir, folder, "tanh", normalize=True)


def test_impala_exports_its_policy_and_loads_without_ray(tmp_path):
    run_dir, folder, manifest = trained("impala", tmp_path, "impala", *RL, "fragment_length=32", "updates_per_step=2",
                                        "hidden=[32]", "activation=relu", "driver.max_steps=3")
    assert set(manifest["files"]) == {"policy.pt"}
    model = manifest["model"]
    assert model["net"] == {"hidden": [32], "activation": "relu"} and not model["normalize_obs"] and model["version"] == 6
    check_policy_reloads(tmp_path, run_dir, folder, "relu", normalize=False)


def test_linreg_exports_its_weights_and_they_reproduce_the_runs_weight_error(tmp_path):
    run_dir, folder, manifest = trained("linreg", tmp_path, "linreg", *COMMON, "rows=8192", "features=8", "shards=4",
                                        "workers=1", "max_workers=2", "driver.max_steps=5")
    assert set(manifest["files"]) == {"model.pt"} and manifest["model"] == {"features": 8, "seed": 0, "noise": 0.1}
    x, _ = rows(GradWorkerConfig(0, 8, 0.1), 0, 100)
    np.save(tmp_path / "x.npy", x)
    script = f"""
import json, numpy as np, ray
from raylane.api import load_model
model = load_model({str(folder)!r})
assert not ray.is_initialized() and not model.training
w = model.weight.detach().numpy()[0]
np.save({str(tmp_path / 'p.npy')!r}, model.predict(np.load({str(tmp_path / 'x.npy')!r})))
print(json.dumps({{"w": w.tolist()}}))
"""
    w = np.array(json.loads(in_fresh_process(script))["w"])
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == manifest["step"]
    assert float(np.linalg.norm(w - true_weights(0, 8))) == pytest.approx(last["weight_error"], rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), x @ w, rtol=1e-12)
