"""V-trace against the paper's sum form and against GAE on-policy; the staleness filter;
the asynchronous learner on real fragments (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from raylane.actors.impala_learner import ImpalaLearner, ImpalaLearnerConfig, concat_fragments
from raylane.actors.ppo_learner import gae
from raylane.actors.rollout_worker import RolloutConfig, Sampler
from raylane.actors.vtrace import split_stale, vtrace
from raylane.jobs.rl_env import check_env

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def random_rollout(rng: np.random.Generator, T: int = 40, N: int = 5):
    rewards = rng.normal(size=(T, N))
    values = rng.normal(size=(T, N))
    ends = rng.random((T, N))
    terminated = ends < 0.08
    truncated = (ends >= 0.08) & (ends < 0.14)
    final_values = np.where(terminated | truncated, rng.normal(size=(T, N)), 0.0)
    last_values = rng.normal(size=N)
    behaviour = np.log(rng.uniform(0.05, 1.0, size=(T, N)))
    target = np.log(rng.uniform(0.05, 1.0, size=(T, N)))
    return behaviour, target, rewards, values, terminated, truncated, final_values, last_values


def paper_vtrace(behaviour, target, rewards, values, terminated, truncated, final_values, last_values, gamma, rho_bar, c_bar, lam):
    """Eq. (1) of Espeholt et al. written out element by element: v_s = V(x_s) +
    sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t over the rest of the episode inside the
    fragment, with the value after an episode end 0 (terminated) or V(final) (truncated)."""
    T, N = rewards.shape
    vs = np.zeros((T, N))
    adv = np.zeros((T, N))

    def next_value(t, n):
        if terminated[t, n]:
            return 0.0
        if truncated[t, n]:
            return final_values[t, n]
        return values[t + 1, n] if t + 1 < T else last_values[n]

    def rho(t, n):
        return min(rho_bar, np.exp(target[t, n] - behaviour[t, n]))

    def c(t, n):
        return lam * min(c_bar, np.exp(target[t, n] - behaviour[t, n]))

    for n in range(N):
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                delta = rho(t, n) * (rewards[t, n] + gamma * next_value(t, n) - values[t, n])
                total += gamma ** (t - s) * trace * delta
                if terminated[t, n] or truncated[t, n]:
                    break
                trace *= c(t, n)
            vs[s, n] = values[s, n] + total
    for n in range(N):
        for s in range(T):
            if terminated[s, n] or truncated[s, n] or s + 1 == T:
                nxt = next_value(s, n)
            else:
                nxt = vs[s + 1, n]
            adv[s, n] = rho(s, n) * (rewards[s, n] + gamma * nxt - values[s, n])
    return vs, adv


@pytest.mark.parametrize("rho_bar,c_bar,lam", [(1.0, 1.0, 1.0), (2.0, 0.5, 1.0), (1.0, 1.0, 0.9), (100.0, 100.0, 1.0)])
def test_vtrace_equals_the_papers_sum_form_with_terminations_and_truncations(rho_bar, c_bar, lam):
    rng = np.random.default_rng(7)
    args = random_rollout(rng)
    out = vtrace(*args, gamma=0.97, rho_clip=rho_bar, c_clip=c_bar, lam=lam)
    vs, adv = paper_vtrace(*args, 0.97, rho_bar, c_bar, lam)
    np.testing.assert_allclose(out.vs, vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.pg_advantages, adv, rtol=1e-5, atol=1e-5)
    assert args[4].any() and args[5].any()  # both kinds of episode end occur


@pytest.mark.parametrize("lam", [1.0, 0.8])
def test_on_policy_vtrace_is_gae(lam):
    rng = np.random.default_rng(3)
    behaviour, _, rewards, values, terminated, truncated, final_values, last_values = random_rollout(rng)
    out = vtrace(behaviour, behaviour, rewards, values, terminated, truncated, final_values, last_values, gamma=0.99, lam=lam)
    adv, ret = gae(rewards, values, terminated, truncated, final_values, last_values, 0.99, lam)
    np.testing.assert_allclose(out.vs, ret, rtol=1e-4, atol=1e-4)
    if lam == 1.0:  # then the pg advantage r + gamma v_{s+1} - V is the GAE(1) advantage
        np.testing.assert_allclose(out.pg_advantages, adv, rtol=1e-4, atol=1e-4)


def test_importance_weights_are_clipped():
    T, N = 3, 1
    zeros = np.zeros((T, N))
    no = np.zeros((T, N), bool)
    behaviour = np.log(np.full((T, N), 0.1))
    target = np.zeros((T, N))  # pi/mu = 10
    out = vtrace(behaviour, target, np.ones((T, N)), zeros, no, no, zeros, np.zeros(N), gamma=1.0, rho_clip=1.0, c_clip=1.0)
    np.testing.assert_allclose(out.vs[:, 0], [3.0, 2.0, 1.0])  # clipped to on-policy returns
    np.testing.assert_allclose(out.rhos, 10.0, rtol=1e-5)
    huge = vtrace(behaviour - 1e4, target, np.ones((T, N)), zeros, no, no, zeros, np.zeros(N), gamma=1.0)
    assert np.isfinite(huge.vs).all()


def test_the_staleness_filter_keeps_fragments_within_the_bound():
    keep, drop = split_stale([10, 9, 7, 6, 11], current=10, bound=3)
    assert keep == [0, 1, 2] and drop == [3, 4]  # 6 is 4 versions old; 11 comes from a policy rolled back
    assert split_stale([5, 5], current=5, bound=0) == ([0, 1], [])


def fragments(spec, n_frags=3, T=20):
    out = []
    for k in range(n_frags):
        s = Sampler(RolloutConfig("CartPole-v1", 2 + k, 100 * k, spec))
        out.append(s.sample(T))
    return out


def test_fragments_of_different_widths_concatenate_with_their_episode_ends():
    spec = check_env("CartPole-v1")
    frags = fragments(spec, T=60)
    joined = concat_fragments(frags)
    assert joined["obs"].shape[:2] == (60, 2 + 3 + 4)
    ends = np.argwhere(joined["terminated"] | joined["truncated"])
    assert sorted(map(tuple, joined["final_idx"])) == sorted(map(tuple, ends))
    np.testing.assert_array_equal(joined["last_obs"][2:5], frags[1]["last_obs"])


@pytest.mark.parametrize("loss", ["vtrace", "appo"])
def test_the_learner_updates_on_fragments_and_refuses_a_nan_batch(loss):
    spec = check_env("CartPole-v1")
    learner = ImpalaLearner(ImpalaLearnerConfig(spec=spec, loss=loss, passes=2))
    before = {k: v.clone() for k, v in learner.net.state_dict().items()}
    stats = learner.update(fragments(spec))
    assert stats["applied"] == 1.0 and np.isfinite(stats["loss"]) and learner.version == 1
    assert any((before[k] != v).any() for k, v in learner.net.state_dict().items())
    bad = fragments(spec)
    bad[0]["rewards"][0, 0] = np.nan
    kept = {k: v.clone() for k, v in learner.net.state_dict().items()}
    stats = learner.update(bad)
    assert stats["applied"] == 0.0 and np.isnan(stats["loss"]) and learner.version == 1
    assert all((kept[k] == v).all() for k, v in learner.net.state_dict().items())
