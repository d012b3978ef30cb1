"""A workload of your own: data-parallel training of an ordinary torch classifier.

Your model and data are plain functions (``make_model``, ``load_data``). Gradient workers
are a task pool on spot capacity: each step they compute the gradients of fixed shards of
the batch (a shard whose worker died runs again on another) and the driver adds them in
shard order, so a run that loses workers ends with the weights of one that lost none.

    raylane run examples/dp_classifier.py:JOB --set workers=3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
import torch.nn.functional as F

from raylane.api import BaseWorkload, Context, DriverConfig, JobSpec, RoleSpec, TaskPool

ROLE = "gradient_worker"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Handwritten digits (8x8, shipped with scikit-learn): train x, y, then test x, y."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    return x[:1500], y[:1500], x[1500:], y[1500:]


@dataclass
class DPConfig:
    """Data-parallel training of a small classifier on the digits set."""

    workers: int = 2
    """Gradient workers to start (they may be lost and replaced)."""
    shards: int = 4
    """Shards of each batch: a shard is one unit of work, fixed so the maths does not depend on the workers."""
    batch_size: int = 256
    """Rows per step."""
    lr: float = 0.3
    """SGD step size (momentum 0.9)."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=60, checkpoint_every_steps=10))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not 1 <= self.shards <= self.batch_size:
            raise ValueError(f"shards must be in 1..batch_size ({self.batch_size}), got {self.shards}")


@ray.remote
class GradientWorker:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = make_model()
        self.x, self.y, _, _ = load_data()

    def grad(self, weights: dict, rows: np.ndarray) -> tuple[list[torch.Tensor], float]:
        self.model.load_state_dict(weights)
        self.model.zero_grad()
        loss = F.cross_entropy(self.model(self.x[rows]), self.y[rows], reduction="sum")
        loss.backward()
        return [p.grad for p in self.model.parameters()], float(loss)


class DPWorkload(BaseWorkload):
    name = "dp_classifier"
    main_metric = "accuracy"
    guarded_metrics = ("loss",)

    def __init__(self, config: DPConfig):
        self.config = config
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=config.lr, momentum=0.9)
        _, _, self.test_x, self.test_y = load_data()
        self.pool: TaskPool | None = None

    def roles(self) -> list[RoleSpec]:
        return [RoleSpec(ROLE, {"CPU": 0.5}, min_count=1, max_count=max(8, self.config.workers), want=self.config.workers)]

    def setup(self, ctx: Context) -> None:
        self.pool = TaskPool(self.roles()[0], GradientWorker, size=max(1, min(self.config.workers, ctx.count(ROLE))), call_timeout_s=120)
        self.pool.wait_ready(timeout_s=120)

    def step(self, step: int) -> dict[str, Any]:
        c = self.config
        rows = np.random.default_rng(step).choice(1500, c.batch_size, replace=False)
        weights = ray.put(self.model.state_dict())
        tickets = [self.pool.submit("grad", weights, part) for part in np.array_split(rows, c.shards)]
        done = self.pool.gather(tickets, timeout_s=300)
        grads = [sum(g) / c.batch_size for g in zip(*(done[t][0] for t in tickets))]  # shard order
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g
        self.opt.step()
        with torch.no_grad():
            accuracy = float((self.model(self.test_x).argmax(1) == self.test_y).float().mean())
        return {"loss": sum(done[t][1] for t in tickets) / c.batch_size, "accuracy": accuracy, "workers": self.pool.size}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def pools(self) -> dict[str, TaskPool]:
        return {} if self.pool is None else {ROLE: self.pool}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


JOB = JobSpec("dp_classifier", "Data-parallel training of a torch classifier over spot gradient workers.", DPConfig, DPWorkload)
