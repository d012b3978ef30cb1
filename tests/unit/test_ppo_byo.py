"""PPO on the user's own parts, without Ray: env kwargs, wrappers by import path, the
built-in network's activation, a network factory of their own, and the async vector
backend; each bad input refused with what to change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylane.actors.envs import EnvRecipe, make_vector_env
from raylane.actors.policy import ACTIVATIONS, ActorCritic, NumpyPolicy, TorchPolicy
from raylane.actors.ppo_learner import Learner, LearnerConfig
from raylane.actors.rollout_worker import RolloutConfig, Sampler
from raylane.config import ConfigError, load_config
from raylane.jobs.ppo import PPOConfig
from raylane.jobs.rl_env import resolve

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture
def user(plugin):
    """The name of a user's module (env, wrappers, network factories) importable from here."""
    return plugin


def conf(user: str, *overrides: str) -> PPOConfig:
    return config("ppo", f"env_id={user}:RaylaneTest/Corridor-v0", *overrides)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_workers_numpy_network_computes_what_the_learners_torch_network_does(activation):
    """The workers act with a numpy copy of the network (fast); for each activation its
    actions' log-probabilities and values are the torch network's, to float32 rounding."""
    from raylane.jobs.rl_env import check_env

    spec = check_env("CartPole-v1")
    torch.manual_seed(0)
    net = ActorCritic(spec, (32, 16), activation)
    params = {k: v.numpy() for k, v in net.state_dict().items()}
    obs = np.random.default_rng(0).normal(size=(64, spec.obs_dim)).astype(np.float32)
    a, logp, value = NumpyPolicy(spec, params, np.random.default_rng(1), activation).act(obs)
    with torch.no_grad():
        dist, v = net.dist_value(torch.as_tensor(obs))
        want_logp = net.log_prob(dist, torch.as_tensor(a)).numpy()
    np.testing.assert_allclose(value, v.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)


def test_env_kwargs_reach_the_env_and_a_kwarg_it_refuses_is_named(user):
    recipe, _, _ = resolve(conf(user, "env_kwargs.length=2"))
    env = make_vector_env(recipe, 1)
    env.reset(seed=0)
    _, r1, *_ = env.step(np.array([1]))
    _, r2, term, *_ = env.step(np.array([1]))
    assert (r1[0], r2[0], bool(term[0])) == (0.0, 1.0, True)  # the end is 2 steps away, not 5
    with pytest.raises(ConfigError, match=r"refused env_kwargs \{'width': 3\}.*unexpected keyword argument 'width'"):
        conf(user, "env_kwargs.width=3")


def test_wrappers_by_import_path_wrap_every_copy_in_order(user):
    with pytest.raises(ConfigError, match=r"wrapper 'gymnasium.wrappers:ClipReward' failed on .*min_reward"):  # it needs bounds
        conf(user, 'wrappers=["gymnasium.wrappers:ClipReward"]')
    for order, rewards in (("triple_reward plus_one", {1.0, 4.0}), ("plus_one triple_reward", {3.0, 6.0})):
        paths = ", ".join(f'"{user}:{w}"' for w in order.split())
        recipe, _, spec = resolve(conf(user, "env_kwargs.length=1", f"wrappers=[{paths}]"))
        batch = Sampler(RolloutConfig(recipe, 2, 0, spec)).sample(16)
        assert set(np.unique(batch["rewards"]).tolist()) == rewards, order  # the first named wraps the env first


@pytest.mark.parametrize("wrapper, message", [
    ("no_such_module_here:Wrap", "wrapper 'no_such_module_here:Wrap': importing module 'no_such_module_here' failed: ModuleNotFoundError"),
    ("gymnasium.wrappers:NoSuchWrapper", "module 'gymnasium.wrappers' has no 'NoSuchWrapper'"),
    ("numpy:pi", "wrapper 'numpy:pi' is a float, not a callable env -> env"),
    ("builtins:str", "wrapper 'builtins:str' returned str, not a gymnasium Env"),
])
def test_a_wrapper_that_does_not_import_or_wrap_is_refused_by_name(user, wrapper, message):
    with pytest.raises(ConfigError, match=message):
        conf(user, f'wrappers=["{wrapper.format(user=user)}"]')


def test_a_users_network_trains_in_the_learner_and_acts_in_the_workers(user):
    recipe, net, spec = resolve(conf(user, f"policy={user}:tiny_policy"))
    learner = Learner(LearnerConfig(spec=spec, net=net, epochs=2))
    assert any(k.startswith("body.head") for k in learner.weights()["params"])  # the user's layers, wrapped
    sampler = Sampler(RolloutConfig(recipe, 3, 0, spec, net))
    assert isinstance(sampler.policy, TorchPolicy)
    before = {k: v.copy() for k, v in learner.weights()["params"].items()}
    for _ in range(3):
        sampler.set_weights(learner.weights())
        batch = sampler.sample(32)
        assert batch["actions"].shape == (32, 3) and set(np.unique(batch["actions"])) <= {0, 1}
        stats = learner.update([batch])
        assert np.isfinite(stats["loss"])
    after = learner.weights()["params"]
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    # the behaviour log-probabilities the worker recorded are the learner's network's own
    sampler.set_weights(learner.weights())
    batch = sampler.sample(4)
    with torch.no_grad():
        dist = learner.net.dist(torch.as_tensor(batch["obs"].reshape(-1, spec.obs_dim)))
        lp = learner.net.log_prob(dist, torch.as_tensor(batch["actions"].reshape(-1))).numpy()
    np.testing.assert_allclose(batch["logp"].reshape(-1), lp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy, message", [
    ("{user}:listed_policy", "returned list, not a torch.nn.Module"),
    ("{user}:one_output_policy", r"forward returned Tensor; forward\(obs \[B, 1\]\) must return \(out \[B, 2\], value \[B\]\)"),
    ("{user}:no_such_factory", "has no 'no_such_factory'"),
])
def test_a_network_factory_that_does_not_build_a_usable_network_is_refused(user, policy, message):
    with pytest.raises(ConfigError, match=message):
        conf(user, f"policy={policy.format(user=user)}")


def test_a_factory_with_the_builtin_networks_settings_says_they_would_be_ignored(user):
    with pytest.raises(ConfigError, match=r"hidden and activation would be ignored"):
        conf(user, f"policy={user}:tiny_policy", "hidden=[8]", "activation=relu")


def test_the_async_backend_steps_the_same_episodes_as_the_sync_one():
    """One subprocess per env copy, same seeds and policy: the very same samples."""
    from raylane.jobs.rl_env import check_env

    spec = check_env("CartPole-v1")
    sync = Sampler(RolloutConfig(EnvRecipe("CartPole-v1"), 3, 7, spec, vector="sync"))
    asyn = Sampler(RolloutConfig(EnvRecipe("CartPole-v1"), 3, 7, spec, vector="async"))
    try:
        a, b = sync.sample(100), asyn.sample(100)
        assert a["episode_returns"] and a["episode_returns"] == b["episode_returns"]
        for key in ("obs", "actions", "rewards", "terminated", "truncated", "final_values"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    finally:
        asyn.env.close()
        sync.env.close()


def test_an_unknown_vector_backend_lists_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"vector: 'threads' is not one of 'sync', 'async'"):
        load_config(PPOConfig, overrides=["vector=threads"])
