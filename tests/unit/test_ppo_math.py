"""PPO pieces without Ray: GAE, the loss, the sampler, env checks, learner state."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from raylane import config as cfg
from raylane.actors.policy import ActorCritic, SpaceSpec, UnsupportedSpaceError
from raylane.actors.ppo_learner import Learner, LearnerConfig, gae, ppo_loss
from raylane.actors.rollout_worker import RolloutConfig, Sampler
from raylane.checkpoint import CheckpointStore
from raylane.jobs.ppo import PPOConfig
from raylane.jobs.rl_env import check_env

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_gae_matches_a_hand_computation_with_termination_and_truncation():
    # One env, 4 steps: step 1 terminates, step 2 is an ordinary step, step 3 truncates.
    g, lam = 0.9, 0.5
    r = np.array([[1.0], [2.0], [3.0], [4.0]])
    v = np.array([[0.5], [1.0], [1.5], [2.0]])
    term = np.array([[False], [True], [False], [False]])
    trunc = np.array([[False], [False], [False], [True]])
    final = np.array([[0.0], [9.0], [0.0], [7.0]])  # V(final obs); ignored where terminated
    last = np.array([100.0])  # V after the rollout; ignored since the last step ended an episode
    adv, ret = gae(r, v, term, trunc, final, last, g, lam)
    d3 = 4.0 + g * 7.0 - 2.0  # truncated: bootstrap from the final observation's value
    a3 = d3
    d2 = 3.0 + g * 2.0 - 1.5
    a2 = d2 + g * lam * a3
    d1 = 2.0 + 0.0 - 1.0  # terminated: no bootstrap
    a1 = d1  # trace cut at the episode end
    d0 = 1.0 + g * 1.0 - 0.5
    a0 = d0 + g * lam * a1
    np.testing.assert_allclose(adv[:, 0], [a0, a1, a2, a3], rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0], np.array([a0, a1, a2, a3]) + v[:, 0], rtol=1e-6)


def test_gae_bootstraps_the_rollout_end_from_last_values():
    r = np.zeros((2, 2))
    v = np.zeros((2, 2))
    no = np.zeros((2, 2), dtype=bool)
    adv, _ = gae(r, v, no, no, np.zeros((2, 2)), np.array([1.0, 2.0]), 0.5, 1.0)
    np.testing.assert_allclose(adv, [[0.25, 0.5], [0.5, 1.0]])


def test_ppo_loss_matches_a_direct_computation():
    torch.manual_seed(0)
    spec = SpaceSpec(obs_dim=3, discrete=True, act_dim=2)
    net = ActorCritic(spec, (8,))
    obs = torch.randn(6, 3)
    act = torch.tensor([0, 1, 1, 0, 1, 0])
    old_logp = torch.log(torch.tensor([0.4, 0.6, 0.3, 0.5, 0.9, 0.2]))
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    ret = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    loss, stats = ppo_loss(net, obs, act, old_logp, adv, ret, clip=0.2, vf_coef=0.5, ent_coef=0.01)
    with torch.no_grad():
        probs = torch.softmax(net.pi(obs), -1)
        p = probs[torch.arange(6), act]
        ratio = p / old_logp.exp()
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        pg = -surrogate.mean()
        vl = 0.5 * ((net.v(obs).squeeze(-1) - ret) ** 2).mean()
        ent = -(probs * probs.log()).sum(-1).mean()
        expected = pg + 0.5 * vl - 0.01 * ent
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert stats["policy_loss"] == pytest.approx(pg.item(), rel=1e-5)
    assert stats["entropy"] == pytest.approx(ent.item(), rel=1e-5)


def test_sampler_shapes_seeds_and_determinism():
    spec = check_env("CartPole-v1")
    a = Sampler(RolloutConfig("CartPole-v1", 3, 1000, spec))
    out = a.sample(64)
    assert out["obs"].shape == (64, 3, 4) and out["actions"].shape == (64, 3) and out["last_values"].shape == (3,)
    assert out["seeds"] == [1000, 1001, 1002]
    ended = out["terminated"] | out["truncated"]
    assert len(out["episode_returns"]) == int(ended.sum()) > 0
    assert sum(out["episode_lengths"]) <= 64 * 3
    b = Sampler(RolloutConfig("CartPole-v1", 3, 1000, spec)).sample(64)
    np.testing.assert_array_equal(out["actions"], b["actions"])  # same seed, same rollout
    c = Sampler(RolloutConfig("CartPole-v1", 3, 2000, spec)).sample(64)
    assert not np.array_equal(out["obs"], c["obs"])


def test_sampler_bootstraps_truncated_episodes_with_the_final_value():
    spec = check_env("Pendulum-v1")  # never terminates, truncates at 200 steps
    s = Sampler(RolloutConfig("Pendulum-v1", 2, 7, spec))
    out = s.sample(200)
    assert out["truncated"][-1].all() and not out["terminated"].any()
    assert np.all(out["final_values"][-1] != 0.0) and np.all(out["final_values"][:-1] == 0.0)
    assert out["actions"].shape == (200, 2, 1)


def test_learner_state_round_trips_through_a_checkpoint(tmp_path):
    spec = check_env("CartPole-v1")
    learner = Learner(LearnerConfig(spec=spec, epochs=2))
    batch = Sampler(RolloutConfig("CartPole-v1", 2, 5, spec)).sample(32)
    learner.update([batch], 0.1)
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"learner": learner.state()})
    other = Learner(LearnerConfig(spec=spec, epochs=2, seed=99))
    other.load_state(store.load(1)[1]["learner"])
    assert other.version == learner.version == 1
    for k, v in learner.net.state_dict().items():
        torch.testing.assert_close(other.net.state_dict()[k], v)
    # Same state, same next update: optimizer moments and the shuffling RNG came back too.
    s1 = learner.update([batch], 0.2)
    s2 = other.update([batch], 0.2)
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-6)


def test_unknown_env_id_suggests_close_matches():
    with pytest.raises(ValueError, match=r"env_id 'CartPol-v1' is not a registered gymnasium environment\. Did you mean 'CartPole-v1'"):
        check_env("CartPol-v1")
    with pytest.raises(cfg.ConfigError, match="env_id 'Nope-v0'"):
        config("ppo", "env_id=Nope-v0")


class DictObsEnv(gym.Env):
    observation_space = gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,))})
    action_space = gym.spaces.Discrete(2)


class TextActionEnv(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,))
    action_space = gym.spaces.Text(5)


def test_unsupported_spaces_are_refused_naming_the_space():
    gym.register("RaylaneTest/DictObs-v0", entry_point=DictObsEnv)
    gym.register("RaylaneTest/TextAct-v0", entry_point=TextActionEnv)
    with pytest.raises(UnsupportedSpaceError, match=r"observation space Dict\(.*is not supported"):
        check_env("RaylaneTest/DictObs-v0")
    with pytest.raises(UnsupportedSpaceError, match=r"action space Text\(.*is not supported.*Discrete or Box actions"):
        check_env("RaylaneTest/TextAct-v0")


@pytest.mark.parametrize("override, message", [
    ("workers=0", "workers: must be >= 1, got 0"),
    ("envs_per_worker=0", "envs_per_worker: must be >= 1, got 0"),
    ("envs_per_worker=-2", "envs_per_worker: must be >= 1, got -2"),
    ("rollout_steps=0", "rollout_steps: must be >= 1, got 0"),
    ("gamma=1.5", "gamma: must be <= 1, got 1.5"),
])
def test_bad_ppo_config_is_refused(override, message):
    with pytest.raises(cfg.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.load_config(PPOConfig, overrides=[override])


@pytest.mark.parametrize("spec", [SpaceSpec(5, True, 3), SpaceSpec(5, False, 2, (-1.0, -1.0), (1.0, 1.0))])
def test_numpy_inference_matches_the_torch_network(spec):
    from raylane.actors.policy import NumpyPolicy

    torch.manual_seed(1)
    net = ActorCritic(spec, (16, 16))
    if not spec.discrete:
        with torch.no_grad():
            net.log_std.fill_(-0.5)
    pol = NumpyPolicy(spec, {k: v.numpy() for k, v in net.state_dict().items()}, np.random.default_rng(0))
    obs = np.random.default_rng(2).normal(size=(7, 5)).astype(np.float32)
    a, logp, v = pol.act(obs)
    with torch.no_grad():
        ot = torch.from_numpy(obs)
        ref_logp = net.log_prob(net.dist(ot), torch.as_tensor(a, dtype=torch.int64 if spec.discrete else torch.float32))
        np.testing.assert_allclose(logp, ref_logp.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v, net.value(ot).numpy(), rtol=1e-4, atol=1e-5)
