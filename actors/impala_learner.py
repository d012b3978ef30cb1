"""The asynchronous learner: V-trace targets with IMPALA's or APPO's policy loss.

A stateful role (prefers on-demand nodes, takes a GPU where its node has one). It is a
:class:`raylane.actors.ppo_learner.Learner` (same network, optimizer, weights and
checkpoint state) whose update takes fragments made by older policies and corrects for
them with V-trace (:mod:`raylane.actors.vtrace`), re-evaluating every value with its own
network.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import ray
import torch
from torch import nn

from raylane.actors.policy import ActorCritic, NetConfig, SpaceSpec
from raylane.actors.ppo_learner import Learner, LearnerHost
from raylane.checkpoint_parts import CHECKPOINT_GROUPS
from raylane.actors.vtrace import vtrace


@dataclass(frozen=True)
class ImpalaLearnerConfig:
    """The learner's slice of the ``impala`` config."""

    spec: SpaceSpec
    """The environment's spaces."""
    net: NetConfig = field(default_factory=NetConfig)
    """The network (built-in MLPs, or the user's factory)."""
    loss: Literal["vtrace", "appo"] = "appo"
    """``vtrace``: IMPALA's policy gradient weighted by V-trace advantages; ``appo``: the
    PPO clipped surrogate on V-trace advantages."""
    lr: float = 5e-4
    """Adam learning rate (annealed linearly to 0 over the run when ``anneal``)."""
    anneal: bool = True
    """Anneal the learning rate linearly with progress."""
    gamma: float = 0.99
    """Discount factor."""
    lam: float = 1.0
    """Trace-cutting lambda of V-trace (1: the paper's plain V-trace)."""
    rho_clip: float = 1.0
    """Clip of the importance weights in the TD errors and the policy gradient (rho bar)."""
    c_clip: float = 1.0
    """Clip of the trace coefficients (c bar)."""
    clip: float = 0.2
    """APPO's surrogate clip range."""
    passes: int = 1
    """Gradient steps on each batch."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    max_grad_norm: float = 0.5
    """Gradient clipping norm."""
    norm_adv: bool = True
    """Normalise the policy-gradient advantages per batch."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before V-trace."""
    seed: int = 0
    """Seed of the network initialisation."""
    normalize_obs: bool = False
    """Always off here: workers' observations go to the learner as they are."""


def impala_loss(net: ActorCritic, frag: dict, cfg: ImpalaLearnerConfig, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one batch of fragments concatenated along the env axis ([T, N])."""
    T, N = frag["rewards"].shape
    k = frag["final_obs"].shape[0]
    dist, values = net.dist_value(torch.as_tensor(frag["obs"].reshape(T * N, -1), device=device))
    with torch.no_grad():  # the bootstrap values: episode ends and the fragment's end
        boot = net.value(torch.as_tensor(np.concatenate([frag["final_obs"], frag["last_obs"]]), device=device)).cpu().numpy()
    act = torch.as_tensor(frag["actions"].reshape(T * N, *frag["actions"].shape[2:]), device=device)
    logp = net.log_prob(dist, act)
    with torch.no_grad():
        final_v = np.zeros((T, N), np.float32)
        if k:
            idx = frag["final_idx"]
            final_v[idx[:, 0], idx[:, 1]] = boot[:k]
        vt = vtrace(frag["logp"], logp.detach().cpu().numpy().reshape(T, N), frag["rewards"] * cfg.reward_scale,
                    values.detach().cpu().numpy().reshape(T, N), frag["terminated"], frag["truncated"], final_v,
                    boot[k:], gamma=cfg.gamma, rho_clip=cfg.rho_clip, c_clip=cfg.c_clip, lam=cfg.lam)
    adv = torch.as_tensor(vt.pg_advantages.reshape(-1), device=device)
    if cfg.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    vs = torch.as_tensor(vt.vs.reshape(-1), device=device)
    if cfg.loss == "appo":
        ratio = (logp - torch.as_tensor(frag["logp"].reshape(-1), device=device)).exp()
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()
    else:  # V-trace's pg advantages already carry the clipped importance weight
        pg_loss = -(adv * logp).mean()
    v_loss = 0.5 * (values - vs).pow(2).mean()
    entropy = net.entropy(dist).mean()
    loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy
    stats = {"policy_loss": pg_loss.item(), "value_loss": v_loss.item(), "entropy": entropy.item(),
             "rho_mean": float(vt.rhos.mean()), "rho_clipped": float((vt.rhos > cfg.rho_clip).mean())}
    return loss, stats


def concat_fragments(frags: list[dict]) -> dict:
    """Fragments of one length side by side along the env axis (their own env counts)."""
    out = {}
    for key in ("obs", "actions", "logp", "rewards", "terminated", "truncated"):
        out[key] = np.concatenate([f[key] for f in frags], axis=1)
    offsets = np.cumsum([0] + [f["rewards"].shape[1] for f in frags[:-1]])
    out["final_idx"] = np.concatenate([f["final_idx"] + np.array([0, off]) for f, off in zip(frags, offsets)]).reshape(-1, 2)
    out["final_obs"] = np.concatenate([f["final_obs"] for f in frags])
    out["last_obs"] = np.concatenate([f["last_obs"] for f in frags])
    return out


class ImpalaLearner(Learner):
    """V-trace updates on one device; the part of the learner actor that needs no Ray."""

    cfg: ImpalaLearnerConfig  # type: ignore[assignment]

    def update(self, batches: list[dict], progress: float = 0.0) -> dict[str, float]:
        """``passes`` gradient steps on the fragments; a non-finite loss leaves the
        parameters and optimizer as they were and reports NaN (as PPO's learner does)."""
        c = self.cfg
        frac = max(0.0, 1.0 - progress) if c.anneal else 1.0
        for g in self.opt.param_groups:
            g["lr"] = c.lr * frac
        frag = concat_fragments(batches)
        before_net = {k: v.clone() for k, v in self.net.state_dict().items()}
        before_opt = copy.deepcopy(self.opt.state_dict())
        losses, stats = [], {}
        for _ in range(c.passes):
            loss, stats = impala_loss(self.net, frag, c, self.device)
            if not torch.isfinite(loss):
                self.net.load_state_dict(before_net)
                self.opt.load_state_dict(before_opt)
                return {"loss": float("nan"), **stats, "applied": 0.0}
            self.opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
            self.opt.step()
            losses.append(loss.item())
        self.version += 1
        return {"loss": float(np.mean(losses)), **stats, "lr": c.lr * frac, "applied": 1.0}


class ImpalaLearnerHost(LearnerHost):
    """An :class:`ImpalaLearner` in an actor (:data:`ImpalaLearnerActor`): the methods of PPO's learner actor.
    ``update`` takes the fragments as separate arguments (object references resolved
    by Ray, so they come from the workers' nodes, not through the driver)."""

    def __init__(self, cfg: ImpalaLearnerConfig):
        torch.set_num_threads(1)
        self.learner = ImpalaLearner(cfg)  # type: ignore[arg-type]

    def update_fragments(self, progress: float, *fragments: dict) -> tuple[dict, dict]:
        stats = self.learner.update(list(fragments), progress)
        return stats, self.learner.weights()


ImpalaLearnerActor = ray.remote(concurrency_groups=CHECKPOINT_GROUPS)(ImpalaLearnerHost)
