"""envpool's batched C++ environments behind the interface the rollout workers step.

envpool (an optional extra: ``pip install "raylane[envpool]"``) steps every copy of an env
it ships in C++ threads, in one call. Its autoreset is NEXT_STEP: the step after an
episode ends resets that copy (its action ignored, reward 0). The workers' advantage
estimate needs gymnasium's SAME_STEP semantics instead (the reset observation in the
step that ended the episode, the last one in ``info["final_obs"]``), so after a step that
ended episodes this wrapper steps just those copies once more, which is their reset.
Written by hand because envpool has no SAME_STEP mode and gymnasium's wrappers do not
wrap envpool's batched env.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raylane.actors.env_errors import EnvBuildError

INSTALL = 'pip install "raylane[envpool]"'


class EnvpoolError(EnvBuildError):
    """An env envpool cannot make as configured, with what to change."""


def envpool_ids() -> list[str]:
    import envpool

    return sorted(envpool.list_all_envs())


def _module():
    try:
        import envpool
    except ImportError:
        raise EnvpoolError(f"vector=envpool needs the envpool package: {INSTALL}") from None
    return envpool


def check(env_id: str, kwargs: dict[str, Any], wrappers: tuple) -> None:
    """Refuse what envpool cannot do, naming it: an id it does not ship, wrappers."""
    envpool = _module()
    if wrappers:
        raise EnvpoolError("vector=envpool steps envpool's own C++ envs, which gymnasium wrappers cannot wrap: "
                           "drop wrappers or use vector=sync|async")
    if env_id not in envpool.list_all_envs():
        near = [e for e in envpool.list_all_envs() if env_id.split("-")[0].lower() in e.lower()][:8]
        raise EnvpoolError(f"envpool ships no env {env_id!r}" + (f"; near: {', '.join(near)}" if near else "")
                           + " (envpool.list_all_envs() lists them); or use vector=sync|async")


class EnvpoolVectorEnv:
    """``num_envs`` copies of an envpool env with SAME_STEP autoreset. Made at the first
    ``reset`` (envpool takes its seed when it is made: copy i gets ``seed + i``)."""

    def __init__(self, env_id: str, num_envs: int, kwargs: dict[str, Any] | None = None):
        import gymnasium as gym

        self.env_id, self.num_envs, self.kwargs = env_id, num_envs, dict(kwargs or {})
        self.env = self._make(0)
        self.single_observation_space = self.env.observation_space
        self.single_action_space = self.env.action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self._all = np.arange(num_envs, dtype=np.int32)

    def _make(self, seed: int):
        try:
            # One C++ thread unless env_kwargs gives num_threads: a rollout worker holds a share
            # of a CPU, and envpool's default (a thread per copy) oversubscribes the node.
            return _module().make_gymnasium(self.env_id, num_envs=self.num_envs, seed=int(seed), **{"num_threads": 1, **self.kwargs})
        except (TypeError, ValueError, RuntimeError) as exc:
            raise EnvpoolError(f"envpool could not make {self.env_id!r} with env_kwargs {self.kwargs}: {exc}") from None

    def reset(self, seed: int | list[int] | None = None, options: dict | None = None):
        if seed is not None:
            first = int(seed[0] if isinstance(seed, (list, tuple, np.ndarray)) else seed)
            if isinstance(seed, (list, tuple, np.ndarray)) and list(seed) != list(range(first, first + self.num_envs)):
                raise EnvpoolError(f"envpool seeds copy i with seed + i; seeds {list(seed)[:4]}... are not consecutive")
            self.env.close()
            self.env = self._make(first)
        obs, info = self.env.reset()
        return obs, info

    def step(self, actions):
        obs, rew, term, trunc, info = self.env.step(np.asarray(actions), self._all)
        if not np.array_equal(info["env_id"], self._all):  # results come in the order of env_id
            order = np.argsort(info["env_id"])
            obs, rew, term, trunc = obs[order], rew[order], term[order], trunc[order]
        done = np.logical_or(term, trunc)
        if done.any():
            ids = np.flatnonzero(done).astype(np.int32)
            final = np.zeros_like(obs)
            final[ids] = obs[ids]
            # The copies that ended take their reset step now; their actions are ignored.
            fresh, _, _, _, again = self.env.step(np.asarray(actions)[ids], ids)
            obs = obs.copy()
            obs[np.asarray(again["env_id"])] = fresh
            info = dict(info)
            info["final_obs"] = final
            info["_final_obs"] = done
        return obs, rew, term, trunc, info

    def spaces(self):
        """(single observation space, single action space)."""
        return self.single_observation_space, self.single_action_space

    def close(self) -> None:
        self.env.close()
