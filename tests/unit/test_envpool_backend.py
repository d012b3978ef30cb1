"""The envpool vector backend without Ray: envpool's NEXT_STEP autoreset turned into the
SAME_STEP semantics the samplers' advantage estimate needs, a sampler on it, and what
envpool cannot do refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from raylane.actors.envs import EnvBuildError, EnvRecipe, make_vector_env
from raylane.actors.rollout_worker import RolloutConfig, Sampler
from raylane.config import ConfigError
from raylane.jobs.ppo import PPOWorkload
from raylane.jobs.rl_env import envpool_spec

from prepared import inputs  # tests/prepared.py

pytest.importorskip("envpool")  # in the test extra; a bare install need not have it
pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360  # CartPole's termination bounds


def test_an_episode_that_ends_returns_its_last_observation_and_the_reset_one_in_the_same_step():
    env = make_vector_env(EnvRecipe("CartPole-v1"), 4, "envpool")
    obs, _ = env.reset(seed=[3, 4, 5, 6])
    lengths, ended = np.zeros(4, dtype=int), 0
    try:
        for _ in range(300):
            obs, rew, term, trunc, info = env.step(np.ones(4, dtype=np.int64))  # always push right: short episodes
            lengths += 1
            assert (rew == 1.0).all()  # never envpool's reward-0 reset step
            for i in np.flatnonzero(term | trunc):
                final = info["final_obs"][i]
                assert abs(final[0]) > X_LIMIT or abs(final[2]) > THETA_LIMIT  # the state that ended it
                assert (np.abs(obs[i]) <= 0.05).all()  # a fresh start, returned at once
                assert 5 <= lengths[i] <= 30
                lengths[i], ended = 0, ended + 1
        assert ended >= 20
    finally:
        env.close()


def test_the_same_seeds_step_the_same_episodes():
    runs = []
    for _ in range(2):
        env = make_vector_env(EnvRecipe("CartPole-v1"), 3, "envpool")
        env.reset(seed=[7, 8, 9])
        rng = np.random.default_rng(0)
        runs.append([env.step(rng.integers(0, 2, 3))[0] for _ in range(100)])
        env.close()
    np.testing.assert_array_equal(np.stack(runs[0]), np.stack(runs[1]))


def test_a_sampler_on_envpool_gives_the_batches_of_the_other_backends():
    spec = envpool_spec(EnvRecipe("CartPole-v1"))
    s = Sampler(RolloutConfig(EnvRecipe("CartPole-v1"), 4, 7, spec, vector="envpool"))
    try:
        out = s.sample(200)
    finally:
        s.env.close()
    assert out["obs"].shape == (200, 4, 4) and out["actions"].shape == (200, 4)
    assert (out["rewards"] == 1.0).all() and len(out["episode_returns"]) >= 4
    ends = out["terminated"] | out["truncated"]
    assert (out["final_values"][~ends] == 0).all() and (out["final_values"][ends] != 0).all()


@pytest.mark.parametrize("overrides, message", [
    (["vector=envpool", "wrappers=[gymnasium.wrappers:FlattenObservation]"], r"gymnasium wrappers cannot wrap: drop wrappers or use vector=sync\|async"),
    (["vector=envpool", "env_id=CartPole-v7"], r"envpool ships no env 'CartPole-v7'; near: .*CartPole-v1"),
    (["vector=envpool", "env_module=os"], r"vector=envpool makes only the envs envpool ships"),
    (["vector=envpool", "env_kwargs.nosuch=3"], r"envpool could not make 'CartPole-v1' with env_kwargs \{'nosuch': 3\}"),
])
def test_what_envpool_cannot_do_is_refused_before_ray_starts(overrides, message):
    with pytest.raises((ConfigError, EnvBuildError), match=message):
        PPOWorkload(*inputs("ppo", *overrides))
