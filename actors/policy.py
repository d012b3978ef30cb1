"""The actor-critic network shared by rollout workers (inference on CPU) and the
learner (training, on a GPU where the node has one), and the spaces it supports.

The built-in network is two MLPs (layer sizes and activation from the config), acted
with in numpy by the workers. A network of the user's own comes from a factory named by
import path: ``factory(spec) -> nn.Module`` whose ``forward(obs [B, obs_dim])`` returns
``(out [B, act_dim], value [B])``, ``out`` being the action logits (Discrete) or the
action mean (Box; raylane adds a learned log standard deviation). :func:`check_factory`
tries it on a batch before any actor starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _elu(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# name: (torch module, the same function in numpy for the workers' fast path)
ACTIVATIONS: dict[str, tuple[type[nn.Module], Callable[[np.ndarray], np.ndarray]]] = {
    "tanh": (nn.Tanh, np.tanh), "relu": (nn.ReLU, _relu), "elu": (nn.ELU, _elu), "silu": (nn.SiLU, _silu),
}


def _mlp(sizes: list[int], out_gain: float, activation: str = "tanh") -> nn.Sequential:
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
            layers.append(ACTIVATIONS[activation][0]())
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate policy and value MLPs. Discrete: categorical logits. Box: a Gaussian
    with a state-independent log standard deviation."""

    def __init__(self, spec: SpaceSpec, hidden: tuple[int, ...] = (64, 64), activation: str = "tanh"):
        super().__init__()
        self.spec = spec
        sizes = [spec.obs_dim, *hidden]
        self.pi = _mlp(sizes + [spec.act_dim], 0.01, activation)
        self.v = _mlp(sizes + [1], 1.0, activation)
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.zeros(spec.act_dim))

    def _dist(self, out_ba: torch.Tensor):
        if self.spec.discrete:
            return Categorical(logits=out_ba)
        return Normal(out_ba, self.log_std.exp().expand_as(out_ba))

    def dist(self, obs_bd: torch.Tensor):
        return self._dist(self.pi(obs_bd))

    def value(self, obs_bd: torch.Tensor) -> torch.Tensor:
        return self.v(obs_bd).squeeze(-1)

    def dist_value(self, obs_bd: torch.Tensor):
        """The action distribution and the value, in one pass where the network allows."""
        return self.dist(obs_bd), self.value(obs_bd)

    def log_prob(self, dist, act: torch.Tensor) -> torch.Tensor:
        lp = dist.log_prob(act)
        return lp if self.spec.discrete else lp.sum(-1)

    def entropy(self, dist) -> torch.Tensor:
        e = dist.entropy()
        return e if self.spec.discrete else e.sum(-1)


class CustomActorCritic(ActorCritic):
    """A user's network (``forward(obs) -> (out, value)``) under the same interface."""

    def __init__(self, spec: SpaceSpec, body: nn.Module):
        nn.Module.__init__(self)
        self.spec = spec
        self.body = body
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.zeros(spec.act_dim))

    def dist(self, obs_bd: torch.Tensor):
        return self.dist_value(obs_bd)[0]

    def value(self, obs_bd: torch.Tensor) -> torch.Tensor:
        return self.dist_value(obs_bd)[1]

    def dist_value(self, obs_bd: torch.Tensor):
        out_ba, value = self.body(obs_bd)
        return self._dist(out_ba), value.reshape(-1)


@dataclass(frozen=True)
class NetConfig:
    """Which network PPO trains: the built-in MLPs, or the user's factory."""

    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer sizes of the built-in policy and value MLPs."""
    activation: str = "tanh"
    """Activation of the built-in MLPs: one of :data:`ACTIVATIONS`."""
    factory: Callable[[SpaceSpec], nn.Module] | None = None
    """The user's ``factory(spec) -> nn.Module``; None for the built-in network."""
    name: str = ""
    """The factory's import path, for messages."""


class PolicyFactoryError(ValueError):
    """A policy factory that does not build a usable network, with what it must return."""


def build_net(spec: SpaceSpec, net: NetConfig) -> ActorCritic:
    if net.factory is None:
        return ActorCritic(spec, net.hidden, net.activation)
    body = net.factory(spec)
    if not isinstance(body, nn.Module):
        raise PolicyFactoryError(f"policy {net.name!r} returned {type(body).__name__}, not a torch.nn.Module; "
                                 "it must return a module whose forward(obs) gives (out [B, act_dim], value [B])")
    return CustomActorCritic(spec, body)


def check_factory(spec: SpaceSpec, net: NetConfig) -> None:
    """Build the user's network and run it on a batch of 3 zero observations; raises
    :class:`PolicyFactoryError` naming the factory and what it must return."""
    if net.factory is None:
        return
    model = build_net(spec, net)
    want = f"forward(obs [B, {spec.obs_dim}]) must return (out [B, {spec.act_dim}], value [B])"
    try:
        got = model.body(torch.zeros(3, spec.obs_dim))
    except Exception as exc:  # noqa: BLE001 - the user's forward: say where it failed
        raise PolicyFactoryError(f"policy {net.name!r}: forward on a batch of 3 observations failed ({type(exc).__name__}: {exc}); {want}") from None
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise PolicyFactoryError(f"policy {net.name!r}: forward returned {type(got).__name__}; {want}")
    out, value = got
    if tuple(out.shape) != (3, spec.act_dim) or value.numel() != 3:
        raise PolicyFactoryError(f"policy {net.name!r}: forward gave out {tuple(out.shape)} and value {tuple(value.shape)}; {want}")


class TorchPolicy:
    """Acting with a user's network in torch (no numpy twin exists for it)."""

    def __init__(self, spec: SpaceSpec, net: NetConfig, params: dict[str, Any], seed: int):
        self.spec = spec
        self.model = build_net(spec, net)
        self.model.eval()
        self.gen = torch.Generator().manual_seed(seed)
        self.load(params)

    def load(self, params: dict[str, Any]) -> None:
        self.model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in params.items()})

    @torch.no_grad()
    def value(self, obs_nd: np.ndarray) -> np.ndarray:
        return self.model.value(torch.as_tensor(obs_nd, dtype=torch.float32)).double().numpy()

    @torch.no_grad()
    def act(self, obs_nd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dist, value = self.model.dist_value(torch.as_tensor(obs_nd, dtype=torch.float32))
        if self.spec.discrete:
            a = torch.multinomial(dist.probs, 1, generator=self.gen)[:, 0]
        else:
            a = dist.mean + dist.stddev * torch.randn(dist.mean.shape, generator=self.gen)
        return a.numpy(), self.model.log_prob(dist, a).double().numpy(), value.double().numpy()


def acting_policy(spec: SpaceSpec, net: NetConfig, params: dict[str, Any], rng: np.random.Generator, seed: int,
                  current: "NumpyPolicy | TorchPolicy | None" = None) -> "NumpyPolicy | TorchPolicy":
    """What a rollout worker acts with: numpy for the built-in MLPs (fast), torch for a
    user's network (``current``, when given, is loaded with ``params`` and kept)."""
    if net.factory is None:
        return NumpyPolicy(spec, params, rng, net.activation)
    if isinstance(current, TorchPolicy):
        current.load(params)
        return current
    return TorchPolicy(spec, net, params, seed)


class NumpyPolicy:
    """Inference with the :class:`ActorCritic` parameters in plain numpy.

    Rollout workers step a handful of envs at a time, where torch's per-call overhead
    (~190 us for a 64x64 MLP and a distribution object) dwarfs the maths; this path
    takes ~27 us, which is most of a worker's sampling throughput.
    """

    def __init__(self, spec: SpaceSpec, params: dict[str, np.ndarray], rng: np.random.Generator, activation: str = "tanh"):
        self.spec = spec
        self.rng = rng
        self.fn = ACTIVATIONS[activation][1]
        self.pi = self._layers(params, "pi")
        self.v = self._layers(params, "v")
        self.log_std = np.asarray(params["log_std"], dtype=np.float32) if "log_std" in params else None
        self.both = self._fuse(self.pi, self.v)
        self._rows = np.arange(0)  # row indices of the last batch size (picking each row's logit)

    @staticmethod
    def _fuse(pi: list, v: list) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The two MLPs as one of twice the width (block-diagonal weights after the first
        layer): act() then costs one matmul per layer instead of two. At a handful of envs
        the per-call overhead, not the flops, is what a step pays. None when the layer
        counts differ."""
        if len(pi) != len(v):
            return None
        fused = []
        for i, ((wp, bp), (wv, bv)) in enumerate(zip(pi, v)):
            if i == 0:
                w = np.concatenate([wp, wv], axis=1)
            else:
                w = np.zeros((wp.shape[0] + wv.shape[0], wp.shape[1] + wv.shape[1]), dtype=wp.dtype)
                w[: wp.shape[0], : wp.shape[1]] = wp
                w[wp.shape[0]:, wp.shape[1]:] = wv
            fused.append((w, np.concatenate([bp, bv])))
        return fused

    @staticmethod
    def _layers(params: dict[str, np.ndarray], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
        idx = sorted({int(k.split(".")[1]) for k in params if k.startswith(prefix + ".")})
        # float32 like the learner's network and the observations: a float64 weight would
        # make every matmul convert the batch first (~40% of the call at a handful of envs)
        return [(np.ascontiguousarray(np.asarray(params[f"{prefix}.{i}.weight"], dtype=np.float32).T),
                 np.asarray(params[f"{prefix}.{i}.bias"], dtype=np.float32)) for i in idx]

    def _mlp(self, x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        for i, (w, b) in enumerate(layers):
            x = x @ w + b
            if i < len(layers) - 1:
                x = self.fn(x)
        return x

    def value(self, obs_nd: np.ndarray) -> np.ndarray:
        return self._mlp(obs_nd, self.v)[:, 0]

    def act(self, obs_nd: np.ndarray, noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(actions, log-probabilities, values) for a batch of observations. ``noise``: this
        step's draws, shaped like the network's output (standard Gumbel for Discrete
        actions, standard normal for Box), when the caller drew a whole fragment's at once."""
        if self.both is not None:
            both = self._mlp(obs_nd, self.both)
            out, value = both[:, :-1], both[:, -1]
        else:
            out, value = self._mlp(obs_nd, self.pi), self.value(obs_nd)
        if self.spec.discrete:
            if noise is None:
                noise = self.rng.gumbel(size=out.shape)
            a = (out + noise).argmax(-1)  # Gumbel-max: a categorical sample
            if len(self._rows) != len(a):
                self._rows = np.arange(len(a))
            z = out - out.max(-1, keepdims=True)
            logp = z[self._rows, a] - np.log(np.exp(z).sum(-1))  # only the chosen actions' log-softmax
        else:
            if noise is None:
                noise = self.rng.standard_normal(out.shape)
            std = np.exp(self.log_std)
            a = out + std * noise
            logp = (-0.5 * noise.astype(np.float32) ** 2 - self.log_std - np.float32(0.5 * np.log(2 * np.pi))).sum(-1)
        return a, logp, value


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
