"""``raylane run linreg``: data-parallel least squares over a pool of gradient workers.

The smallest end-to-end workload: each step the driver sends the weights once
(object store), the pool computes gradients of fixed row shards on whatever workers
are alive, and the sums are added in shard order, so a run that loses workers,
is scaled, or is killed and resumed ends with exactly the same weights.

Exported (``raylane export``), the weights are ``model.pt`` and load back as
:class:`LinearModel`: ``model.predict(x)`` gives ``x @ w`` for rows ``x [n, features]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from raylane import budget
from raylane import config as cfg
from raylane.budget import Estimate
from raylane.actors.grad_worker import GradWorker, GradWorkerConfig, true_weights
from raylane.api import BaseWorkload, Context, DriverConfig, JobSpec, RoleSpec, TaskPool
from raylane.launch import job_main
from raylane.placement import split_by_speed

ROLE = "grad_worker"


@dataclass
class LinRegConfig:
    """Least-squares regression on generated data."""

    rows: int = cfg.field(65_536, ge=1)
    """Rows of generated data."""
    features: int = cfg.field(16, ge=1)
    """Features per row."""
    shards: int = cfg.field(8, ge=1)
    """Row shards; a shard is one unit of work. Fixed, so the maths does not depend on the worker count."""
    workers: int = cfg.field(2, ge=1)
    """Gradient workers to start."""
    max_workers: int = cfg.field(8, ge=1)
    """Most gradient workers the pool may grow to."""
    lr: float = cfg.field(0.5, gt=0)
    """Gradient-descent step size."""
    noise: float = cfg.field(0.1, ge=0)
    """Label noise standard deviation."""
    target_loss: float = cfg.field(0.0, ge=0)
    """Stop once the mean squared error is at or below this (0: run all steps)."""
    seed: int = 0
    """Seed of the generated problem."""
    step_timeout_s: float = cfg.field(120.0, gt=0)
    """Longest a step may wait for its gradients."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=50))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        if self.shards > self.rows:
            raise ValueError(f"shards ({self.shards}) must not exceed rows ({self.rows})")
        if self.workers > self.max_workers:
            raise ValueError(f"workers ({self.workers}) must not exceed max_workers ({self.max_workers})")


def check_budget(c: LinRegConfig) -> None:
    """Refuse sizes the workers or the driver cannot hold. The rows live on the workers: any
    worker may serve any shard and keeps up to 16 (its row cache), so one worker can hold
    min(shards, 16) shards of rows / shards rows, each row features + 1 (the label) float64s,
    plus the shard it is building (its generated blocks, then their concatenation). The
    driver holds only weights: w, the gradient, the update and the true weights, 8 bytes
    each per feature."""
    shard_rows = -(-c.rows // c.shards)
    held = min(c.shards, 16) + 1
    budget.check(LinRegWorkload.name, [Estimate(
        f"generated rows: {held} shards (up to 16 cached, one being built) of rows ({c.rows:,}) / shards ({c.shards}) "
        f"x (features ({c.features}) + 1) x 8 bytes", held * shard_rows * (c.features + 1) * 8, ("rows", "features"))], where="gradient worker")
    budget.check(LinRegWorkload.name, [Estimate(f"weights: features ({c.features:,}) x 8 bytes x 4 copies", c.features * 8 * 4, "features")])


class LinRegWorkload(BaseWorkload):
    name = "linreg"
    main_metric = "loss"
    guarded_metrics = ("loss",)
    metrics = ("loss", "weight_error", "workers")

    def __init__(self, config: LinRegConfig):
        self.config = config
        check_budget(config)
        self.w = np.zeros(config.features)
        sizes = split_by_speed(config.rows, [1.0] * config.shards)
        bounds = np.cumsum([0] + sizes)
        self.shards = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.pool: TaskPool | None = None

    def roles(self) -> list[RoleSpec]:
        return [RoleSpec(ROLE, {"CPU": 1.0}, min_count=1, max_count=self.config.max_workers, want=self.config.workers)]

    def setup(self, ctx: Context) -> None:
        c = self.config
        worker_cfg = GradWorkerConfig(c.seed, c.features, c.noise)
        self.pool = ctx.task_pool(ROLE, GradWorker, actor_args=lambda key: ((worker_cfg,), {}), call_timeout_s=c.step_timeout_s, on_timeout="retry")
        self.pool.wait_ready(timeout_s=120)

    def step(self, step: int) -> dict[str, Any]:
        assert self.pool is not None
        w_ref = ray.put(self.w)
        tickets = [self.pool.submit("grad", w_ref, a, b) for a, b in self.shards]
        done = self.pool.gather(tickets, timeout_s=self.config.step_timeout_s)
        grad = np.zeros_like(self.w)
        loss, n = 0.0, 0
        for t in tickets:  # shard order: the sum is the same whoever computed it
            g, l, k = done[t]
            grad += g
            loss += l
            n += k
        self.w = self.w - self.config.lr * (2.0 / n) * grad
        err = float(np.linalg.norm(self.w - true_weights(self.config.seed, self.config.features)))
        return {"loss": loss / n, "weight_error": err, "workers": self.pool.size}

    def state_dict(self) -> dict:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.w = np.asarray(state["w"], dtype=np.float64).copy()

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return bool(self.config.target_loss) and metrics["loss"] <= self.config.target_loss


class LinearModel(torch.nn.Linear):
    """linreg's model: ``features`` inputs, one output, no bias, float64 like the run's weights."""

    def __init__(self, features: int):
        super().__init__(features, 1, bias=False, dtype=torch.float64)

    @torch.no_grad()
    def predict(self, x: Any) -> np.ndarray:
        """Predictions ``[n]`` for rows ``x [n, features]`` (``x @ w``)."""
        x = torch.as_tensor(np.asarray(x, dtype=np.float64))
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; the model reads rows [n, {self.in_features}]")
        return self(x)[:, 0].numpy()


def export(conf: LinRegConfig | None, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export``: the weights as ``model.pt`` (``weight [1, features]``, float64)."""
    w = np.asarray(state["w"], dtype=np.float64).reshape(1, -1)
    torch.save({"weight": torch.from_numpy(w.copy())}, Path(folder) / "model.pt")
    return {"features": w.shape[1], **({"seed": conf.seed, "noise": conf.noise} if conf is not None else {})}


def load_model(folder: Path, manifest: dict) -> LinearModel:
    """``JobSpec.load_model``: :class:`LinearModel` in eval mode."""
    model = LinearModel(int(manifest["model"]["features"]))
    model.load_state_dict(torch.load(Path(folder) / "model.pt", weights_only=True))
    return model.eval()


JOB = JobSpec("linreg", "Least squares on generated data over elastic gradient workers: the smallest end-to-end check of a cluster.", LinRegConfig, LinRegWorkload,
              export=export, load_model=load_model)

if __name__ == "__main__":
    job_main(JOB)
