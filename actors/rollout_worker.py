"""Rollout workers: gymnasium vector environments stepped with a CPU copy of the policy.

A stateless role (prefers spot nodes): a worker holds environments and a policy
copy that arrives with every ``sample`` call, so losing one loses only the steps it
was sampling; a replacement starts with fresh seeds and gets the weights with its
first call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from raylane.actors.envs import EnvRecipe, make_vector_env
from raylane.actors.policy import NetConfig, NumpyPolicy, RunningMeanStd, SpaceSpec, acting_policy, build_net
from raylane.cluster import MARKET_LABEL, SPEED_LABEL


def node_speed_market(labels: dict[str, str]) -> tuple[float, str]:
    """A node's relative speed and market from its labels (1.0 and on-demand without)."""
    try:
        speed = float(labels.get(SPEED_LABEL, 1.0))
    except ValueError:
        speed = 1.0
    return (speed if speed > 0 else 1.0), labels.get(MARKET_LABEL, "on-demand")


def this_node() -> tuple[str, float, str]:
    """The id, speed and market of the node the calling actor runs on."""
    ctx = ray.get_runtime_context()
    return (ctx.get_node_id(), *node_speed_market(ctx.get_node_labels() or {}))


@dataclass(frozen=True)
class RolloutConfig:
    """One rollout worker's slice of the job's config."""

    env: EnvRecipe | str
    """How to make one env copy (a plain string: a gymnasium id without kwargs or wrappers)."""
    num_envs: int
    """Environment copies stepped together in one vector env."""
    seed: int
    """This worker's seed; env copy i is seeded ``seed + i``."""
    spec: SpaceSpec
    """The environment's spaces, checked by the driver before any worker started."""
    net: NetConfig = field(default_factory=NetConfig)
    """The policy network (built-in MLPs, or the user's factory)."""
    vector: str = "sync"
    """Vector-env backend: see :data:`raylane.actors.envs.VECTOR_BACKENDS`."""
    emulate_step_s: float = 0.0
    """Emulated slow nodes, for tests and benchmarks only: every vector step sleeps
    ``emulate_step_s / speed`` (the node's ``raylane.io/speed`` label). 0 (off) in real runs."""


class Sampler:
    """Steps a vector env with a policy; the part of a rollout worker that needs no Ray."""

    def __init__(self, cfg: RolloutConfig, step_delay_s: float = 0.0):
        torch.set_num_threads(1)
        self.cfg = cfg
        self.step_delay_s = step_delay_s  # see RolloutConfig.emulate_step_s
        self.env = make_vector_env(cfg.env, cfg.num_envs, cfg.vector)
        self.seeds = [cfg.seed + i for i in range(cfg.num_envs)]
        self.obs, _ = self.env.reset(seed=self.seeds)
        self.env.action_space.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.rng = np.random.default_rng(cfg.seed)
        initial = {k: v.numpy() for k, v in build_net(cfg.spec, cfg.net).state_dict().items()}
        self.policy = acting_policy(cfg.spec, cfg.net, initial, self.rng, cfg.seed)
        self.rms = RunningMeanStd(cfg.spec.obs_dim)
        self.normalize = False
        self.version = -1
        self.ep_return = np.zeros(cfg.num_envs)
        self.ep_length = np.zeros(cfg.num_envs, dtype=np.int64)

    def set_weights(self, weights: dict) -> None:
        # Always load: after a recovery the learner reuses version numbers with other
        # parameters, so a version check could keep stale weights (and loading is ~us).
        self.normalize = bool(weights.get("normalize", True))
        self.policy = acting_policy(self.cfg.spec, self.cfg.net, weights["params"], self.rng, self.cfg.seed, self.policy)
        self.rms.load(weights["obs_rms"])
        self.version = weights["version"]

    def _flat(self, obs: np.ndarray) -> np.ndarray:
        flat = obs.reshape(obs.shape[0], -1)
        return self.rms.normalize(flat) if self.normalize else flat.astype(np.float32)

    def sample(self, num_steps: int) -> dict:
        """``num_steps`` steps of every env copy: arrays shaped [T, N, ...] plus finished episodes."""
        spec, n = self.cfg.spec, self.cfg.num_envs
        obs_tnd = np.zeros((num_steps, n, spec.obs_dim), dtype=np.float32)
        norm = self.normalize
        # Without normalisation the raw observations are the observations: one array, one copy per step.
        raw_tnd = np.zeros((num_steps, n, spec.obs_dim), dtype=np.float32) if norm else obs_tnd
        act_shape = (num_steps, n) if spec.discrete else (num_steps, n, spec.act_dim)
        act = np.zeros(act_shape, dtype=np.int64 if spec.discrete else np.float32)
        logp, val, rew = (np.zeros((num_steps, n), dtype=np.float32) for _ in range(3))
        term, trunc = (np.zeros((num_steps, n), dtype=bool) for _ in range(2))
        final_val = np.zeros((num_steps, n), dtype=np.float32)  # V(final obs) where an episode ended
        returns, lengths = [], []
        final_idx: list[tuple[int, int]] = []
        final_obs: list[np.ndarray] = []
        low = np.asarray(spec.act_low, dtype=np.float32) if not spec.discrete else None
        high = np.asarray(spec.act_high, dtype=np.float32) if not spec.discrete else None
        noise = None  # the numpy policy's random draws for the whole fragment: one call, not one per step
        if isinstance(self.policy, NumpyPolicy):
            shape = (num_steps, n, spec.act_dim)
            noise = (self.rng.gumbel(size=shape) if spec.discrete else self.rng.standard_normal(shape)).astype(np.float32)
        for t in range(num_steps):
            raw = self.obs.reshape(n, -1).astype(np.float32, copy=False)
            o = self.rms.normalize(raw) if norm else raw
            a, lp, v = self.policy.act(o) if noise is None else self.policy.act(o, noise[t])
            obs_tnd[t] = o
            if norm:
                raw_tnd[t] = raw
            act[t], logp[t], val[t] = a, lp, v
            step_a = act[t] if spec.discrete else np.clip(act[t], low, high)
            self.obs, r, te, tr, info = self.env.step(step_a)
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)
            rew[t], term[t], trunc[t] = r, te, tr
            self.ep_return += r
            self.ep_length += 1
            done = te | tr
            if done.any():  # only the copies that ended: their final observations and values
                idx = np.flatnonzero(done)
                fo = info["final_obs"]
                flat_finals = self._flat(np.stack([fo[i] for i in idx]).reshape(len(idx), -1))
                final_val[t, idx] = self.policy.value(flat_finals)
                final_idx.extend((t, int(i)) for i in idx)
                final_obs.extend(flat_finals)
                returns.extend(self.ep_return[idx].tolist())
                lengths.extend(self.ep_length[idx].tolist())
                self.ep_return[idx] = 0.0
                self.ep_length[idx] = 0
        last_obs = self._flat(self.obs)
        last_val = self.policy.value(last_obs)
        return {
            "obs": obs_tnd, "raw_obs": raw_tnd, "actions": act, "logp": logp, "values": val, "rewards": rew,
            "terminated": term, "truncated": trunc, "final_values": final_val, "last_values": last_val,
            "episode_returns": returns, "episode_lengths": lengths, "version": self.version, "seeds": self.seeds,
            # Where episodes ended ([k, 2] of (t, env)), their final observations and the
            # observations after the last step: a learner that re-evaluates values with
            # its own network (V-trace) bootstraps from these.
            "final_idx": np.asarray(final_idx, dtype=np.int64).reshape(-1, 2),
            "final_obs": np.asarray(final_obs, dtype=np.float32).reshape(-1, spec.obs_dim), "last_obs": last_obs,
        }


@ray.remote
class RolloutWorker:
    """A :class:`Sampler` in an actor. The weights ride along with each ``sample`` call (an
    object-store reference, fetched once per node), so a new worker needs no set-up call."""

    def __init__(self, cfg: RolloutConfig):
        _, speed, _ = this_node()
        self.sampler = Sampler(cfg, cfg.emulate_step_s / speed)

    def set_weights(self, weights: dict) -> int:
        self.sampler.set_weights(weights)
        return self.sampler.version

    def sample(self, weights: dict, num_steps: int) -> dict:
        self.sampler.set_weights(weights)
        return self.sampler.sample(num_steps)

    def info(self) -> dict:
        """Where this worker runs and how it is seeded (for logs and fault tests)."""
        import os

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "seeds": self.sampler.seeds}
