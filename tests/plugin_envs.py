"""The source of a user's env module: a tiny env and its gymnasium registration, for the
plugin-env tests to write into a folder and import from there."""

import textwrap

PLUGIN = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np

    class Corridor(gym.Env):
        """Walk right to the end of a corridor: a tiny env registered by a user's module."""

        observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.pos = 0
            return np.array([0.0], np.float32), {}

        def step(self, action):
            self.pos = max(0, self.pos + (1 if action == 1 else -1))
            done = self.pos >= 5
            return np.array([self.pos / 5], np.float32), float(done), done, False, {}

    gym.register("RaylaneTest/Corridor-v0", entry_point=Corridor, max_episode_steps=50)
''')
