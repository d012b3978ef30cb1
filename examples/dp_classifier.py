"""Your own workload: data-parallel training of a torch classifier. Gradient workers (a task
pool on spot capacity) compute the gradients of fixed shards of each batch; a shard whose
worker died runs again elsewhere, and the sums are taken in shard order, so a run that
loses workers ends with the weights of one that lost none.

    raylane run examples/dp_classifier.py:JOB --set workers=3
"""
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from sklearn.datasets import load_digits

from raylane import config as cfg
from raylane.api import BaseWorkload, Context, DriverConfig, JobSpec, RoleSpec


def make_model() -> torch.nn.Module:  # your model
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Your data; here handwritten digits (8x8, shipped with scikit-learn): train x, y, then test x, y."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])
    return x[:1500], y[:1500], x[1500:], y[1500:]


@dataclass
class DPConfig:
    """Data-parallel training of a small classifier on the digits set."""

    workers: int = cfg.field(2, ge=1)
    """Gradient workers to start (they may be lost and replaced)."""
    shards: int = cfg.field(4, ge=1)
    """Shards of each batch: a shard is one unit of work, fixed so the maths does not depend on the workers."""
    batch_size: int = cfg.field(256, ge=1)
    """Rows per step."""
    lr: float = cfg.field(0.3, gt=0)
    """SGD step size (momentum 0.9)."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=60, checkpoint_every_steps=10))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        if self.shards > self.batch_size:
            raise ValueError(f"shards must be at most batch_size ({self.batch_size}), got {self.shards}")


@ray.remote
class GradientWorker:
    def __init__(self) -> None:  # Ray gives the actor OMP_NUM_THREADS=1: one torch thread per worker
        self.model, (self.x, self.y, _, _) = make_model(), load_data()

    def grad(self, weights: dict, rows: np.ndarray) -> tuple[list[torch.Tensor], float]:
        def loss(w: dict) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(torch.func.functional_call(self.model, w, self.x[rows]), self.y[rows], reduction="sum")
        grads, value = torch.func.grad_and_value(loss)(weights)
        return [grads[name] for name, _ in self.model.named_parameters()], float(value)


class DPWorkload(BaseWorkload):
    name, main_metric, guarded_metrics = "dp_classifier", "accuracy", ("loss",)

    def __init__(self, config: DPConfig):
        self.config, self.model = config, make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=config.lr, momentum=0.9)
        _, _, self.test_x, self.test_y = load_data()

    def roles(self) -> list[RoleSpec]:  # the driver sizes, places, replaces and shuts down the role's actors
        return [RoleSpec("gradient_worker", {"CPU": 0.5}, min_count=1, max_count=max(8, self.config.workers), want=self.config.workers)]

    def setup(self, ctx: Context) -> None:
        self.pool = ctx.task_pool("gradient_worker", GradientWorker, call_timeout_s=120)

    def step(self, step: int) -> dict:
        c = self.config
        rows = np.random.default_rng(step).choice(1500, c.batch_size, replace=False)
        weights = ray.put(self.model.state_dict())
        tickets = [self.pool.submit("grad", weights, part) for part in np.array_split(rows, c.shards)]
        done = self.pool.gather(tickets, timeout_s=300)
        for p, *grads in zip(self.model.parameters(), *(done[t][0] for t in tickets)):  # shard order
            p.grad = sum(grads) / c.batch_size
        self.opt.step()
        with torch.no_grad():
            accuracy = float((self.model(self.test_x).argmax(1) == self.test_y).float().mean())
        return {"loss": sum(done[t][1] for t in tickets) / c.batch_size, "accuracy": accuracy, "workers": self.pool.size}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])


JOB = JobSpec("dp_classifier", "Data-parallel training of a torch classifier over spot gradient workers.", DPConfig, DPWorkload)
