"""The source of a user's env module: a tiny env (its corridor's length a constructor
argument) and its gymnasium registration, a reward wrapper and policy network factories
(one good, two wrong), for the bring-your-own tests to write into a folder and import
from there."""

import textwrap

PLUGIN = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np
    import torch
    from torch import nn

    class Corridor(gym.Env):
        """Walk right to the end of a corridor: a tiny env registered by a user's module."""

        observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self, length=5):
            self.length = length

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.pos = 0
            return np.array([0.0], np.float32), {}

        def step(self, action):
            self.pos = max(0, self.pos + (1 if action == 1 else -1))
            done = self.pos >= self.length
            return np.array([self.pos / self.length], np.float32), float(done), done, False, {}

    gym.register("RaylaneTest/Corridor-v0", entry_point=Corridor, max_episode_steps=50)


    def triple_reward(env):
        """A wrapper of the user's own: every reward times 3."""
        return gym.wrappers.TransformReward(env, lambda r: 3.0 * r)


    def plus_one(env):
        """Another: every reward plus 1."""
        return gym.wrappers.TransformReward(env, lambda r: r + 1.0)


    class TinyNet(nn.Module):
        """A user's network: one shared hidden layer, a policy head and a value head."""

        def __init__(self, spec):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(spec.obs_dim, 16), nn.ReLU())
            self.head = nn.Linear(16, spec.act_dim)
            self.v = nn.Linear(16, 1)

        def forward(self, obs):
            h = self.body(obs)
            return self.head(h), self.v(h).squeeze(-1)


    def tiny_policy(spec):
        return TinyNet(spec)


    def listed_policy(spec):
        return [nn.Linear(spec.obs_dim, spec.act_dim)]


    def one_output_policy(spec):
        return nn.Linear(spec.obs_dim, spec.act_dim)
''')
