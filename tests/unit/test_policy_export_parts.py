"""ppo's and impala's policy export without Ray: a learner's checkpointed state (the built-in
network with normalised observations, a user's network factory) written by
:func:`raylane.actors.policy_export.export` and loaded back computes what the run's rollout
workers computed; a state that does not describe its network falls back to the config, and
without one is refused with what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylane.actors import policy_export
from raylane.actors.policy import NetConfig, NumpyPolicy
from raylane.actors.ppo_learner import Learner, LearnerConfig
from raylane.checkpoint import CheckpointStore
from raylane.jobs.rl_env import check_env, export_policy, resolve

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def checkpointed(tmp_path, learner: Learner) -> dict:
    """The workload state as ``export_run`` hands it over: saved and read back whole."""
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    store.save(1, {"learner": learner.state(), "env_steps": 0})
    return store.load_whole()[1]


def exported(tmp_path, state: dict, conf=None) -> policy_export.PolicyModel:
    folder = tmp_path / "export"
    folder.mkdir(exist_ok=True)
    about = export_policy(conf, state, folder)
    assert set(p.name for p in folder.iterdir()) == {policy_export.MODEL_FILE}
    return policy_export.load(folder, {"model": about})


def test_a_box_policy_with_normalised_observations_acts_as_the_workers_did(tmp_path):
    spec = check_env("Pendulum-v1")
    learner = Learner(LearnerConfig(spec=spec, net=NetConfig((32, 16), "relu"), normalize_obs=True))
    rng = np.random.default_rng(0)
    learner.rms.update(rng.normal(3.0, 2.0, size=(500, spec.obs_dim)))
    with torch.no_grad():
        learner.net.log_std.fill_(-0.5)
    model = exported(tmp_path, checkpointed(tmp_path, learner))
    assert not model.training and model.normalize_obs and model.spec == spec
    obs = rng.normal(3.0, 4.0, size=(64, spec.obs_dim)).astype(np.float32)
    worker = NumpyPolicy(spec, learner.weights()["params"], np.random.default_rng(1), "relu")
    normed = learner.rms.normalize(obs)  # what the rollout workers feed the network
    with torch.no_grad():
        mean, value = model(obs)
    np.testing.assert_allclose(mean.numpy(), worker._mlp(normed, worker.pi), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value.numpy(), worker.value(normed), rtol=1e-5, atol=1e-5)
    greedy = model.act(obs)
    np.testing.assert_allclose(greedy, np.clip(mean.numpy(), spec.act_low, spec.act_high))
    assert model.act(obs[0]).shape == (spec.act_dim,) and model.act(obs, deterministic=False).shape == (64, spec.act_dim)
    torch.testing.assert_close(model.dist(obs).stddev[0], torch.full((spec.act_dim,), float(np.exp(-0.5))))


def test_a_users_network_is_rebuilt_from_its_factory_by_import_path(tmp_path, plugin):
    conf = config("ppo", f"env_id={plugin}:RaylaneTest/Corridor-v0", f"policy={plugin}:tiny_policy")
    _, net, spec = resolve(conf)
    learner = Learner(LearnerConfig(spec=spec, net=net))
    state = checkpointed(tmp_path, learner)
    assert state["learner"]["model"]["net"] == {"policy": f"{plugin}:tiny_policy"}
    model = exported(tmp_path, state, conf)
    obs = np.linspace(0, 1, 8, dtype=np.float32).reshape(8, 1)
    with torch.no_grad():
        want_out, want_value = learner.net.body(torch.as_tensor(obs))
        out, value = model(obs)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(value, want_value)
    assert model.act(obs[3]) == int(want_out[3].argmax())
    gone = {"model": {**state["learner"]["model"], "net": {"policy": "raylane_no_such_module:tiny_policy"}}}
    with pytest.raises(ValueError, match=r"trained with the network of 'raylane_no_such_module:tiny_policy', which does not import here"):
        policy_export.load(tmp_path / "export", gone)


def test_a_state_without_its_description_falls_back_to_the_config_or_is_refused(tmp_path):
    conf = config("ppo", "hidden=[16]", "normalize_obs=true")
    learner = Learner(LearnerConfig(spec=check_env("CartPole-v1"), net=NetConfig((16,)), normalize_obs=True))
    state = checkpointed(tmp_path, learner)
    del state["learner"]["model"]  # as a checkpoint written before the learner described its network
    model = exported(tmp_path, state, conf)
    assert model.normalize_obs and model.spec.discrete and model.act(np.zeros(4, np.float32)) in (0, 1)
    with pytest.raises(ValueError, match=r"does not describe its network and the run folder has no config.json"):
        export_policy(None, state, tmp_path / "export")
    with pytest.raises(ValueError, match=r"no learner state with network parameters"):
        policy_export.export(conf, {"env_steps": 3}, tmp_path / "export")
    with pytest.raises(ValueError, match=r"observations of 3 values; this policy reads 4"):
        model.act(np.zeros(3))
