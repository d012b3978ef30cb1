"""Federated clients: an actor trains the global model on one client's rows for a round.

A stateless role (prefers spot nodes). What is copied into it: its :class:`ClientConfig`
slice; the global weights arrive with each ``train`` call (one object-store copy per
round, fetched once per node). Each actor reads the data itself and keeps the partitions
of the clients it has served, so the driver never ships a client's rows, and one actor
serves any number of logical clients in turn (the pool hands it a client id).

A round's local work: up to ``epochs`` passes over the client's rows in minibatches, or
fewer when the round's deadline (or, for an emulated straggler, its step budget) comes
first; the loss has FedProx's proximal term when ``mu > 0``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch
import torch.nn.functional as F

from raylane.actors.fed_data import FedSource, load
from raylane.actors.fed_math import proximal_term


@dataclass(frozen=True)
class ClientConfig:
    """The client actors' slice of the job's config."""

    source: FedSource
    """Where the rows come from and how they are split (every actor reads them itself)."""
    hidden: int = 64
    """Hidden units of the MLP."""
    lr: float = 0.05
    """Local SGD step size."""
    batch_size: int = 16
    """Rows per local step."""


def make_model(in_dim: int, hidden: int, classes: int, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


class ClientCore:
    """The client's work without Ray."""

    def __init__(self, config: ClientConfig):
        torch.set_num_threads(1)
        self.config = config
        data = load(config.source)
        self.x, self.y, self.parts = data.x, data.y, data.parts
        self.model = make_model(self.x.shape[1], config.hidden, data.classes, config.source.seed)

    def planned_steps(self, client: int, epochs: int) -> int:
        return epochs * math.ceil(len(self.parts[client]) / self.config.batch_size)

    def train(self, client: int, weights: dict, round_: int, *, epochs: int, mu: float, deadline_at: float, budget: int | None = None) -> dict:
        """Local training of ``client`` from the global ``weights`` until its epochs are done,
        ``budget`` steps are done, or the clock passes ``deadline_at`` (Unix time: the
        round's deadline is one moment for every client, however long a call waited in the
        queue); returns the new weights, the client's rows, and the steps done of those planned."""
        t0 = time.monotonic()
        c = self.config
        rows = self.parts[client]
        x, y = torch.from_numpy(self.x[rows]), torch.from_numpy(self.y[rows])
        self.model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        anchor = [p.detach().clone() for p in self.model.parameters()]
        opt = torch.optim.SGD(self.model.parameters(), lr=c.lr)
        planned = self.planned_steps(client, epochs)
        limit = planned if budget is None else min(planned, budget)
        rng = np.random.default_rng([c.source.seed, 19, round_, client])
        steps, loss_sum = 0, 0.0
        for _ in range(epochs):
            order = rng.permutation(len(rows))
            for start in range(0, len(rows), c.batch_size):
                if steps >= limit or time.time() >= deadline_at:
                    break
                pick = order[start : start + c.batch_size]
                loss = F.cross_entropy(self.model(x[pick]), y[pick])
                if mu > 0:
                    loss = loss + proximal_term(list(self.model.parameters()), anchor, mu)
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
                loss_sum += float(loss.detach())
        return {
            "client": client, "weights": {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()},
            "rows": len(rows), "steps": steps, "planned": planned, "loss": loss_sum / max(steps, 1), "seconds": time.monotonic() - t0,
        }


@ray.remote
class FedClient:
    """A :class:`ClientCore` in an actor."""

    def __init__(self, config: ClientConfig):
        self.core = ClientCore(config)

    def train(self, client: int, weights: dict, round_: int, epochs: int, mu: float, deadline_at: float, budget: int | None = None) -> dict:
        return self.core.train(client, weights, round_, epochs=epochs, mu=mu, deadline_at=deadline_at, budget=budget)

    def info(self) -> dict:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
