"""An environment of your own, trained by the built-in ``ppo`` job.

The module registers ``Gridworld-v0`` with gymnasium when it is imported; ``ppo`` imports it
in the driver and in every rollout worker when the id names the module:

    raylane run ppo --set env_id=examples.gridworld:Gridworld-v0 --set target_return=0.9

(run from the folder that holds ``examples/``). An agent walks a ``size`` x ``size`` grid
from the top-left corner to the goal in the bottom-right one; each step costs 0.01, the
goal pays 1 and ends the episode. The best return is ``1 - 0.01 * (2 * size - 3)``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

MOVES = np.array([(0, 1), (1, 0), (0, -1), (-1, 0)])  # right, down, left, up


class Gridworld(gym.Env):
    def __init__(self, size: int = 5):
        if size < 2:
            raise ValueError(f"size must be at least 2, got {size}")
        self.size = size
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(len(MOVES))
        self.pos = np.zeros(2, dtype=np.int64)

    def _obs(self) -> np.ndarray:
        return (self.pos / (self.size - 1)).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.pos = np.zeros(2, dtype=np.int64)
        return self._obs(), {}

    def step(self, action):
        self.pos = np.clip(self.pos + MOVES[int(action)], 0, self.size - 1)
        at_goal = bool((self.pos == self.size - 1).all())
        return self._obs(), (1.0 if at_goal else -0.01), at_goal, False, {}


gym.register(id="Gridworld-v0", entry_point=Gridworld, max_episode_steps=50)
