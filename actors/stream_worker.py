"""Streaming rollout workers for asynchronous RL (``impala``).

A stateless role (prefers spot nodes). A worker keeps its env copies running from one
fragment to the next and hands back fixed-size fragments (``fragment_length`` steps of
every copy) tagged with the policy version that made them and with where they were
made (node, its speed and market). The pool keeps two calls queued at every worker, so
it starts the next fragment the moment one is handed back.

Weights are published by the learner into the object store; each call carries the
reference to the newest, inside a list so that Ray does not fetch it for the call. The
worker fetches (and loads) only a reference it has not loaded yet: a new policy costs
one fetch per worker, not one per call.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import ray

from raylane.actors.rollout_worker import RolloutConfig, Sampler, this_node


@dataclass(frozen=True)
class StreamConfig:
    """One streaming worker's slice of the ``impala`` config."""

    rollout: RolloutConfig
    """The env copies, seeds, spaces and network (``num_envs``: the count on a speed-1 node)."""
    fragment_length: int = 50
    """Steps of every env copy per fragment."""
    envs_by_speed: bool = True
    """Scale the env copies by the node's ``raylane.io/speed`` label (at least 1):
    faster nodes step more copies per fragment."""


def fitted(cfg: StreamConfig, speed: float) -> RolloutConfig:
    """The rollout config a worker on a node of ``speed`` runs."""
    n = max(1, round(cfg.rollout.num_envs * speed)) if cfg.envs_by_speed else cfg.rollout.num_envs
    return dataclasses.replace(cfg.rollout, num_envs=n)


@ray.remote
class StreamWorker:
    """A :class:`Sampler` that hands back fragments; see the module docstring."""

    def __init__(self, cfg: StreamConfig):
        self.node_id, self.speed, self.market = this_node()
        self.cfg = cfg
        self.sampler = Sampler(fitted(cfg, self.speed), cfg.rollout.emulate_step_s / self.speed)
        self._loaded: bytes | None = None

    def fragment(self, weights_box: list) -> dict:
        """One fragment sampled with the newest weights (``weights_box``: [ObjectRef])."""
        ref = weights_box[0]
        if ref.binary() != self._loaded:
            self.sampler.set_weights(ray.get(ref, timeout=120))
            self._loaded = ref.binary()
        t0 = time.perf_counter()
        out = self.sampler.sample(self.cfg.fragment_length)
        out.update(node_id=self.node_id, speed=self.speed, market=self.market, sample_s=time.perf_counter() - t0, pid=os.getpid())
        return out

    def info(self) -> dict:
        """Where this worker runs, how fast its node is and how it is seeded."""
        return {"pid": os.getpid(), "node_id": self.node_id, "speed": self.speed, "market": self.market,
                "num_envs": self.sampler.cfg.num_envs, "seeds": self.sampler.seeds}
