"""The PPO learner: GAE, the clipped surrogate loss, and the optimizer, in a stateful actor.

A stateful role (prefers on-demand nodes, takes a GPU where its node has one). Its
state (weights, optimizer, version, RNG, observation statistics, and a JSON description
of the network for :mod:`raylane.actors.policy_export`) is what a checkpoint holds; the
rollout workers hold nothing that matters.

:func:`gae` and :func:`ppo_loss` are pure and tested against hand computations.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from torch import nn

from raylane.actors.policy import ActorCritic, NetConfig, RunningMeanStd, SpaceSpec, build_net
from raylane.actors.policy_export import describe
from raylane.checkpoint_parts import CHECKPOINT_GROUPS, CheckpointParts


def gae(
    rewards_tn: np.ndarray,
    values_tn: np.ndarray,
    terminated_tn: np.ndarray,
    truncated_tn: np.ndarray,
    final_values_tn: np.ndarray,
    last_values_n: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimates and value targets for a [T, N] rollout.

    The value after step t is V(s_{t+1}) inside an episode; where the episode ended at
    t it is 0 if the env *terminated* and V(final observation) if it was *truncated*
    (time limit: the state had a future, so bootstrap). The advantage trace is cut at
    every episode end, since the next step belongs to a new episode.
    """
    T = rewards_tn.shape[0]
    adv_tn = np.zeros_like(rewards_tn, dtype=np.float64)
    next_adv = np.zeros(rewards_tn.shape[1], dtype=np.float64)
    for t in reversed(range(T)):
        done = terminated_tn[t] | truncated_tn[t]
        following = last_values_n if t == T - 1 else values_tn[t + 1]
        next_value = np.where(done, np.where(terminated_tn[t], 0.0, final_values_tn[t]), following)
        delta = rewards_tn[t] + gamma * next_value - values_tn[t]
        next_adv = delta + gamma * lam * np.where(done, 0.0, next_adv)
        adv_tn[t] = next_adv
    return adv_tn.astype(np.float32), (adv_tn + values_tn).astype(np.float32)


def ppo_loss(
    net: ActorCritic,
    obs_bd: torch.Tensor,
    act_b: torch.Tensor,
    old_logp_b: torch.Tensor,
    adv_b: torch.Tensor,
    ret_b: torch.Tensor,
    *,
    clip: float,
    vf_coef: float,
    ent_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate policy loss + vf_coef * 0.5 * MSE(value) - ent_coef * entropy."""
    dist, value_b = net.dist_value(obs_bd)
    logp_b = net.log_prob(dist, act_b)
    ratio_b = (logp_b - old_logp_b).exp()
    pg_loss = torch.max(-adv_b * ratio_b, -adv_b * ratio_b.clamp(1 - clip, 1 + clip)).mean()
    v_loss = 0.5 * (value_b - ret_b).pow(2).mean()
    entropy = net.entropy(dist).mean()
    loss = pg_loss + vf_coef * v_loss - ent_coef * entropy
    with torch.no_grad():
        approx_kl = ((ratio_b - 1) - (logp_b - old_logp_b)).mean()
        clipfrac = ((ratio_b - 1).abs() > clip).float().mean()
    stats = {"policy_loss": pg_loss.item(), "value_loss": v_loss.item(), "entropy": entropy.item(), "approx_kl": approx_kl.item(), "clipfrac": clipfrac.item()}
    return loss, stats


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's slice of the PPO config."""

    spec: SpaceSpec
    """The environment's spaces."""
    net: NetConfig = field(default_factory=NetConfig)
    """The network (built-in MLPs, or the user's factory)."""
    lr: float = 1e-3
    """Adam learning rate (annealed linearly to 0 over the run when ``anneal``)."""
    anneal: bool = True
    """Anneal the learning rate and the clip range linearly with progress."""
    gamma: float = 0.98
    """Discount factor."""
    lam: float = 0.8
    """GAE lambda."""
    clip: float = 0.2
    """PPO clip range."""
    epochs: int = 20
    """Passes over each batch."""
    minibatches: int = 1
    """Minibatches per epoch."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    max_grad_norm: float = 0.5
    """Gradient clipping norm."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    normalize_obs: bool = False
    """Normalise observations with running statistics (shared with the workers)."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before GAE (keeps value targets near unit scale)."""
    seed: int = 0
    """Seed of the network initialisation and minibatch shuffling."""


class Learner:
    """PPO updates on one device; the part of the learner actor that needs no Ray."""

    def __init__(self, cfg: LearnerConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net = build_net(cfg.spec, cfg.net).to(self.device)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=cfg.lr, eps=1e-5, foreach=True)
        self.rms = RunningMeanStd(cfg.spec.obs_dim)
        self.version = 0
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def weights(self) -> dict:
        """What rollout workers need: parameters (numpy, CPU), observation stats, version."""
        params = {k: v.detach().cpu().numpy() for k, v in self.net.state_dict().items()}
        return {"version": self.version, "params": params, "obs_rms": self.rms.state(), "normalize": self.cfg.normalize_obs}

    def update(self, batches: list[dict], progress: float = 0.0) -> dict[str, float]:
        """One PPO iteration on the workers' batches; returns loss statistics.

        A non-finite loss stops the update: the parameters and optimizer go back to
        where they were before this call and the loss is reported as NaN, so the weights
        (and any later checkpoint) never carry NaN.
        """
        c = self.cfg
        frac = max(0.0, 1.0 - progress) if c.anneal else 1.0
        for g in self.opt.param_groups:
            g["lr"] = c.lr * frac
        clip = c.clip * frac if c.anneal else c.clip
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "actions", "logp", "adv", "ret", "raw_obs")}
        for b in batches:
            adv, ret = gae(b["rewards"] * c.reward_scale, b["values"], b["terminated"], b["truncated"], b["final_values"], b["last_values"], c.gamma, c.lam)
            T, N = b["rewards"].shape
            cols["obs"].append(b["obs"].reshape(T * N, -1))
            cols["raw_obs"].append(b["raw_obs"].reshape(T * N, -1))
            cols["actions"].append(b["actions"].reshape(T * N, *b["actions"].shape[2:]))
            cols["logp"].append(b["logp"].reshape(-1))
            cols["adv"].append(adv.reshape(-1))
            cols["ret"].append(ret.reshape(-1))
        data = {k: torch.as_tensor(np.concatenate(v)).to(self.device) for k, v in cols.items() if k != "raw_obs"}
        n = data["obs"].shape[0]
        mb = max(1, n // c.minibatches)
        before_net = {k: v.clone() for k, v in self.net.state_dict().items()}
        before_opt = copy.deepcopy(self.opt.state_dict())
        stats: dict[str, float] = {}
        losses = []
        for _ in range(c.epochs):
            perm = torch.randperm(n, generator=self.gen).to(self.device)
            for start in range(0, n - mb + 1, mb):
                idx = perm[start : start + mb]
                adv = data["adv"][idx]
                if c.norm_adv and len(idx) > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                loss, stats = ppo_loss(self.net, data["obs"][idx], data["actions"][idx], data["logp"][idx], adv, data["ret"][idx], clip=clip, vf_coef=c.vf_coef, ent_coef=c.ent_coef)
                if not torch.isfinite(loss):
                    self.net.load_state_dict(before_net)
                    self.opt.load_state_dict(before_opt)
                    return {"loss": float("nan"), **stats, "applied": 0.0}
                self.opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
                self.opt.step()
                losses.append(loss.item())
        if c.normalize_obs:
            self.rms.update(np.concatenate(cols["raw_obs"]).astype(np.float64))
        self.version += 1
        return {"loss": float(np.mean(losses)) if losses else float("nan"), **stats, "lr": c.lr * frac, "applied": 1.0}

    def state(self) -> dict:
        buf = io.BytesIO()
        # The optimizer state has int keys and tuples; torch.save of plain containers of
        # tensors is readable back with weights_only=True, so it still cannot run code.
        torch.save(self.opt.state_dict(), buf)
        return {
            "params": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()},
            "optimizer": buf.getvalue(),
            "version": self.version,
            "rng": self.gen.get_state(),
            "obs_rms": self.rms.state(),
            "model": describe(self.cfg.spec, self.cfg.net, self.cfg.normalize_obs),  # what rebuilds the network (the export reads it)
        }

    def load_state(self, state: dict) -> None:
        self.net.load_state_dict({k: torch.as_tensor(v).to(self.device) for k, v in state["params"].items()})
        self.opt.load_state_dict(torch.load(io.BytesIO(state["optimizer"]), weights_only=True, map_location=self.device))
        self.version = int(state["version"])
        self.gen.set_state(torch.as_tensor(state["rng"], dtype=torch.uint8))
        self.rms.load(state["obs_rms"])


class LearnerHost(CheckpointParts):
    """A :class:`Learner` in an actor (:data:`LearnerActor`); see the module docstring
    for what it holds. Plain, so that other learners can share its methods. It writes its
    own checkpoint part (:mod:`raylane.checkpoint_parts`)."""

    def __init__(self, cfg: LearnerConfig):
        torch.set_num_threads(1)
        self.learner = Learner(cfg)

    def info(self) -> dict:
        """Where the learner runs (for logs and fault tests)."""
        import os

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "device": str(self.learner.device)}

    def weights(self) -> dict:
        return self.learner.weights()

    def update(self, batches: list[dict], progress: float) -> tuple[dict, dict]:
        """Update, then return (statistics, new weights) in one round trip."""
        stats = self.learner.update(batches, progress)
        return stats, self.learner.weights()

    def state(self) -> dict:
        return self.learner.state()

    def load_state(self, state: dict) -> int:
        self.learner.load_state(state)
        return self.learner.version

    def export_state(self) -> dict:
        return self.learner.state()

    def import_state(self, state: dict) -> None:
        self.learner.load_state(state)


LearnerActor = ray.remote(concurrency_groups=CHECKPOINT_GROUPS)(LearnerHost)
