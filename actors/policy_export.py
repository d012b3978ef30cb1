"""The policy of ``ppo`` and ``impala`` out of the learner's checkpoint part, as one torch
module, and back (their ``JobSpec.export`` and ``JobSpec.load_model``).

:func:`export` writes ``policy.pt`` (the network's ``state_dict`` under ``net.``, and the
observation statistics ``obs_mean`` / ``obs_var`` when the run normalised observations;
loaded with ``torch.load(weights_only=True)``) and returns what rebuilds the module as
JSON: the env's spaces as the job saw them, the built-in network's layers or the user's
factory by import path, and whether observations are normalised. The learner's state
describes its own network (:func:`describe`); a checkpoint written before it did is
described by the run's config.

:class:`PolicyModel` is the module :func:`load` returns, in eval mode:

- ``model.act(obs)``: the greedy action for an observation as the env gives it (or a batch
  of them): the most likely action (Discrete), the mean clipped to the action bounds (Box);
  ``act(obs, deterministic=False)`` samples from the policy instead.
- ``model(obs)``: the raw forward, ``(out [B, act_dim], value [B])``: the action logits
  (Discrete) or the action mean (Box), and the value estimate.
- ``model.dist(obs)``: the action distribution (``Categorical`` or ``Normal``).

Observations go in raw: the module normalises them as the run's rollout workers did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from raylane.actors.policy import ActorCritic, CustomActorCritic, NetConfig, SpaceSpec, build_net

MODEL_FILE = "policy.pt"
FACTORY_SHAPE = "factory(spec) -> nn.Module"


def describe(spec: SpaceSpec, net: NetConfig, normalize_obs: bool) -> dict[str, Any]:
    """What rebuilds a learner's network, as JSON: the spaces, the built-in network's hidden
    sizes and activation or the user's factory by import path, and whether observations
    are normalised (their statistics are in the learner's state)."""
    from raylane.registry import portable_target  # a factory file's path made absolute: found from any folder

    about_net: dict[str, Any] = ({"hidden": [int(h) for h in net.hidden], "activation": net.activation} if net.factory is None
                                 else {"policy": portable_target(net.name)})
    return {"spec": {"obs_dim": int(spec.obs_dim), "discrete": bool(spec.discrete), "act_dim": int(spec.act_dim),
                     "act_low": [float(x) for x in spec.act_low], "act_high": [float(x) for x in spec.act_high]},
            "net": about_net, "normalize_obs": bool(normalize_obs)}


def space_spec_of(about: dict[str, Any]) -> SpaceSpec:
    """The :class:`SpaceSpec` of a description."""
    s = about["spec"]
    return SpaceSpec(int(s["obs_dim"]), bool(s["discrete"]), int(s["act_dim"]), tuple(map(float, s["act_low"])), tuple(map(float, s["act_high"])))


def net_config_of(about: dict[str, Any]) -> NetConfig:
    """The :class:`NetConfig` of a description; a user's factory is imported by its path."""
    net = about["net"]
    if "policy" not in net:
        return NetConfig(tuple(int(h) for h in net["hidden"]), net["activation"])
    from raylane import imports

    name = net["policy"]
    try:
        factory = imports.load_callable(name, "policy", FACTORY_SHAPE)
    except imports.ImportPathError as exc:
        raise ValueError(f"this policy was trained with the network of {name!r}, which does not import here ({exc}); "
                         "load it where that module imports (from the project folder, or with its folder on PYTHONPATH)") from None
    return NetConfig(factory=factory, name=name)


class PolicyModel(nn.Module):
    """A trained ppo or impala policy: the learner's network and, when the run normalised
    observations, their statistics (see the module docstring for how to act with it)."""

    def __init__(self, spec: SpaceSpec, net: ActorCritic, normalize_obs: bool):
        super().__init__()
        self.spec, self.net, self.normalize_obs = spec, net, normalize_obs
        if normalize_obs:
            self.register_buffer("obs_mean", torch.zeros(spec.obs_dim, dtype=torch.float64))
            self.register_buffer("obs_var", torch.ones(spec.obs_dim, dtype=torch.float64))

    def _batch(self, obs: Any) -> torch.Tensor:
        """Observations ``[B, ...]`` as the network reads them: flattened to ``[B, obs_dim]``,
        float32, normalised (clipped to +-10) as the rollout workers did."""
        x = torch.as_tensor(np.asarray(obs) if not isinstance(obs, torch.Tensor) else obs)
        x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
        if x.shape[1] != self.spec.obs_dim:
            raise ValueError(f"observations of {x.shape[1]} values; this policy reads {self.spec.obs_dim} (the env's observation, flattened)")
        if not self.normalize_obs:
            return x.to(torch.float32)
        z = (x.to(torch.float64) - self.obs_mean) / torch.sqrt(self.obs_var + 1e-8)
        return z.clamp(-10.0, 10.0).to(torch.float32)

    def forward(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, act_dim], value [B])`` of raw observations ``[B, ...]``: the action
        logits (Discrete) or the action mean (Box), and the value estimate."""
        x = self._batch(obs)
        if isinstance(self.net, CustomActorCritic):
            out, value = self.net.body(x)
            return out, value.reshape(-1)
        return self.net.pi(x), self.net.value(x)

    def dist(self, obs: Any) -> torch.distributions.Distribution:
        """The action distribution of raw observations ``[B, ...]``."""
        return self.net._dist(self(obs)[0])

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = True, generator: torch.Generator | None = None) -> np.ndarray:
        """The action for ``obs``, ready for ``env.step``: a 1-D array is one observation
        (one action back), anything else a batch along its first axis (an image env's single
        observation: pass ``obs[None]``). Deterministic: the most likely action (Discrete), the
        mean (Box); else a sample. Box actions are clipped to the action bounds, as the run
        clipped them when stepping."""
        single = np.ndim(obs) == 1
        out = self(obs)[0]
        if self.spec.discrete:
            a = out.argmax(-1) if deterministic else torch.multinomial(torch.softmax(out, -1), 1, generator=generator)[:, 0]
        else:
            a = out if deterministic else out + self.net.log_std.exp() * torch.randn(out.shape, generator=generator)
            a = a.clamp(torch.as_tensor(self.spec.act_low), torch.as_tensor(self.spec.act_high))
        actions = a.numpy()
        return actions[0] if single else actions


def build(about: dict[str, Any]) -> PolicyModel:
    """The untrained :class:`PolicyModel` a description names (the global torch RNG is left as it was)."""
    spec = space_spec_of(about)
    with torch.random.fork_rng(devices=[]):
        net = build_net(spec, net_config_of(about))
    return PolicyModel(spec, net, bool(about["normalize_obs"]))


def _tensors(learner: dict, about: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``policy.pt``'s tensors: the network's under ``net.``, the observation statistics."""
    tensors = {f"net.{k}": torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).detach().clone()
               for k, v in learner["params"].items()}
    if about["normalize_obs"]:
        rms = learner["obs_rms"]
        tensors["obs_mean"] = torch.as_tensor(np.asarray(rms["mean"], np.float64)).clone()
        tensors["obs_var"] = torch.as_tensor(np.asarray(rms["var"], np.float64)).clone()
    return tensors


def export(conf: Any, state: dict, folder: Path, described: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``policy.pt`` and the JSON that rebuilds :class:`PolicyModel` (ppo's and impala's
    ``JobSpec.export`` is :func:`raylane.jobs.rl_env.export_policy`). ``described()``: the
    :func:`describe` of the run's config, for a checkpoint written before the learner's state
    described its network (None: there is no config to ask)."""
    learner = state.get("learner")
    if not isinstance(learner, dict) or not isinstance(learner.get("params"), dict):
        raise ValueError("the checkpoint holds no learner state with network parameters; export a checkpoint of a ppo or impala run")
    about = learner.get("model")
    if about is None and described is None:
        raise ValueError("the checkpoint's learner state does not describe its network and the run folder has no config.json; "
                         "export a checkpoint written by this raylane, or a run started with `raylane run` or raylane.api.run")
    about = about or described()  # type: ignore[misc]
    torch.save(_tensors(learner, about), Path(folder) / MODEL_FILE)
    env = ({"env_id": conf.env_id, "env_module": conf.env_module, "env_kwargs": dict(conf.env_kwargs), "wrappers": list(conf.wrappers)}
           if conf is not None else {})  # which env it acts in (for the reader; the module needs none of it)
    code = [about["net"]["policy"]] if "policy" in about["net"] else []
    return {**about, "version": int(learner.get("version", 0)), **env, "imports": code}


def load(folder: Path, manifest: dict) -> PolicyModel:
    """``JobSpec.load_model`` of ppo and impala: :class:`PolicyModel` in eval mode."""
    model = build(manifest["model"])
    model.load_state_dict(torch.load(Path(folder) / MODEL_FILE, weights_only=True))
    return model.eval()
