"""The actor-critic network shared by rollout workers (inference on CPU) and the
learner (training, on a GPU where the node has one), and the spaces it supports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal


class UnsupportedSpaceError(ValueError):
    """The environment's observation or action space is not one PPO here handles."""


@dataclass(frozen=True)
class SpaceSpec:
    """What the network needs to know about an environment's spaces (plain data, picklable)."""

    obs_dim: int
    """Flattened observation size."""
    discrete: bool
    """True for Discrete actions, False for Box actions."""
    act_dim: int
    """Number of discrete actions, or the size of a Box action."""
    act_low: tuple[float, ...] = ()
    """Lower bounds of a Box action (actions are clipped to them when stepping)."""
    act_high: tuple[float, ...] = ()
    """Upper bounds of a Box action."""


def space_spec(observation_space, action_space) -> SpaceSpec:
    """Check the spaces and describe them; raises naming the space and what is supported."""
    from gymnasium import spaces

    supported = "Box observations (any shape, flattened) with Discrete or Box actions"
    if not isinstance(observation_space, spaces.Box) or not np.issubdtype(observation_space.dtype, np.number):
        raise UnsupportedSpaceError(f"observation space {observation_space} is not supported; raylane PPO supports {supported}")
    obs_dim = int(np.prod(observation_space.shape))
    if isinstance(action_space, spaces.Discrete):
        return SpaceSpec(obs_dim, True, int(action_space.n))
    if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
        return SpaceSpec(obs_dim, False, int(action_space.shape[0]), tuple(map(float, action_space.low)), tuple(map(float, action_space.high)))
    raise UnsupportedSpaceError(f"action space {action_space} is not supported; raylane PPO supports {supported}")


def _mlp(sizes: list[int], out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        # Orthogonal init with a small output gain: the policy starts near uniform and
        # the value near zero, the usual PPO recipe for stable early updates.
        nn.init.orthogonal_(lin.weight, out_gain if last else np.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers.append(lin)
        if not last:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh). Discrete: categorical logits. Box: a
    Gaussian with a state-independent log standard deviation."""

    def __init__(self, spec: SpaceSpec, hidden: tuple[int, ...] = (64, 64)):
        super().__init__()
        self.spec = spec
        sizes = [spec.obs_dim, *hidden]
        self.pi = _mlp(sizes + [spec.act_dim], 0.01)
        self.v = _mlp(sizes + [1], 1.0)
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.zeros(spec.act_dim))

    def dist(self, obs_bd: torch.Tensor):
        out_ba = self.pi(obs_bd)
        if self.spec.discrete:
            return Categorical(logits=out_ba)
        return Normal(out_ba, self.log_std.exp().expand_as(out_ba))

    def value(self, obs_bd: torch.Tensor) -> torch.Tensor:
        return self.v(obs_bd).squeeze(-1)

    def log_prob(self, dist, act: torch.Tensor) -> torch.Tensor:
        lp = dist.log_prob(act)
        return lp if self.spec.discrete else lp.sum(-1)

    def entropy(self, dist) -> torch.Tensor:
        e = dist.entropy()
        return e if self.spec.discrete else e.sum(-1)


class NumpyPolicy:
    """Inference with the :class:`ActorCritic` parameters in plain numpy.

    Rollout workers step a handful of envs at a time, where torch's per-call overhead
    (~190 us for a 64x64 MLP and a distribution object) dwarfs the maths; this path
    takes ~27 us, which is most of a worker's sampling throughput.
    """

    def __init__(self, spec: SpaceSpec, params: dict[str, np.ndarray], rng: np.random.Generator):
        self.spec = spec
        self.rng = rng
        self.pi = self._layers(params, "pi")
        self.v = self._layers(params, "v")
        self.log_std = np.asarray(params["log_std"], dtype=np.float64) if "log_std" in params else None

    @staticmethod
    def _layers(params: dict[str, np.ndarray], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
        idx = sorted({int(k.split(".")[1]) for k in params if k.startswith(prefix + ".")})
        return [(np.asarray(params[f"{prefix}.{i}.weight"], dtype=np.float64).T.copy(), np.asarray(params[f"{prefix}.{i}.bias"], dtype=np.float64)) for i in idx]

    @staticmethod
    def _mlp(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        for i, (w, b) in enumerate(layers):
            x = x @ w + b
            if i < len(layers) - 1:
                x = np.tanh(x)
        return x

    def value(self, obs_nd: np.ndarray) -> np.ndarray:
        return self._mlp(obs_nd, self.v)[:, 0]

    def act(self, obs_nd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(actions, log-probabilities, values) for a batch of observations."""
        out = self._mlp(obs_nd, self.pi)
        if self.spec.discrete:
            z = out - out.max(-1, keepdims=True)
            logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
            a = (out + self.rng.gumbel(size=out.shape)).argmax(-1)  # Gumbel-max: a categorical sample
            logp = np.take_along_axis(logp_all, a[:, None], 1)[:, 0]
        else:
            std = np.exp(self.log_std)
            a = out + std * self.rng.standard_normal(out.shape)
            logp = (-0.5 * ((a - out) / std) ** 2 - self.log_std - 0.5 * np.log(2 * np.pi)).sum(-1)
        return a, logp, self.value(obs_nd)


class RunningMeanStd:
    """Running mean and variance of observations (parallel-variance merge of batches)."""

    def __init__(self, dim: int):
        self.mean = np.zeros(dim, dtype=np.float64)
        self.var = np.ones(dim, dtype=np.float64)
        self.count = 1e-4

    def update(self, x_nd: np.ndarray) -> None:
        b_mean, b_var, b_count = x_nd.mean(0), x_nd.var(0), x_nd.shape[0]
        delta = b_mean - self.mean
        total = self.count + b_count
        self.mean = self.mean + delta * b_count / total
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.var = m2 / total
        self.count = total

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -10.0, 10.0).astype(np.float32)

    def state(self) -> dict:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": float(self.count)}

    def load(self, state: dict) -> None:
        self.mean = np.asarray(state["mean"], dtype=np.float64).copy()
        self.var = np.asarray(state["var"], dtype=np.float64).copy()
        self.count = float(state["count"])
