"""Parameter-server workers: each reads its own rows of the click data and loops
pull -> forward/backward -> push against the shards.

Where it lives: anywhere (a stateless role, spot nodes first). What is copied into it: its
:class:`WorkerConfig` slice (through ``setup``); the shards' handles through :meth:`PSWorker.connect`. Its
batches depend only on (seed, worker, clock), so a replacement, or a clock run again after
a recovery, computes on the same rows; the shards apply a (worker, clock) once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray
import torch

from raylane.actors import ctr
from raylane.actors.ps_layout import dense_slices, row_shard


@dataclass(frozen=True)
class WorkerConfig:
    """One worker's slice of the job's config."""

    index: int
    """This worker's number (the shards' clocks are kept per number)."""
    shape: ctr.CTRShape
    """Data and model shape."""
    rows: tuple[int, int]
    """Its rows of the generated data: [start, stop)."""
    shards: int
    """Parameter shards."""
    batch_size: int = 256
    """Rows per clock."""
    data_seed: int = 0
    """Seed of the generated data."""
    seed: int = 0
    """Seed of the batch order."""
    timeout_s: float = 120.0
    """Longest one pull or push may take."""
    table: Any = None
    """The user's click table (a :class:`raylane.actors.ctr_files.CTRTable`); None: generated data."""


class WorkerCore:
    """The worker without Ray (the shards may be any objects with pull/push returning values)."""

    def __init__(self, config: WorkerConfig):
        torch.set_num_threads(1)
        self.config = config
        if config.table is None:
            self.ids, self.numeric, self.labels = ctr.rows(config.shape, config.data_seed, *config.rows)
        else:  # only this worker's rows of the user's table
            from raylane.actors.ctr_files import read_ctr_rows

            self.ids, self.numeric, self.labels = read_ctr_rows(config.table, config.shape.buckets, *config.rows)
        self.shapes = ctr.dense_shapes(config.shape)
        self.slices = dense_slices({n: int(np.prod(s)) for n, s in self.shapes.items()}, config.shards)

    def batch(self, clock: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        pick = ctr.batch_rows(len(self.labels), c.batch_size, seed=c.seed, worker=c.index, clock=clock)
        return self.ids[pick], self.numeric[pick], self.labels[pick]

    def route(self, uniq: list[np.ndarray]) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
        return route(uniq, self.config.shards)

    def compute(self, clock: int, pulled: Sequence[tuple[dict, dict]], routes, uniq, inv, numeric, labels):
        """Loss and per-shard gradients from the shards' answers."""
        shape = self.config.shape
        dense, tables = assemble(shape, pulled, routes, uniq)
        for t in (*dense.values(), *tables.values()):
            t.requires_grad_(True)
        logits = ctr.forward(shape, dense, tables, inv, torch.from_numpy(numeric))
        loss = ctr.loss_fn(logits, torch.from_numpy(labels))
        loss.backward()
        pushes = []
        for s in range(self.config.shards):
            d = {name: dense[name].grad.reshape(-1)[a:b].numpy().copy() for name, (a, b) in self.slices[s].items()}
            sp = {table: (ids, tables[table].grad[pos].numpy().copy()) for table, (pos, ids) in routes[s].items()}
            pushes.append((d, sp))
        return float(loss.detach()), pushes


def route(uniq: list[np.ndarray], shards: int) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Per shard: table -> (positions among the unique ids of each field, the ids) it holds."""
    out: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(shards)]
    for f, u in enumerate(uniq):
        table = ctr.table_name(f)
        owner = row_shard(table, u, shards)
        for s in range(shards):
            pos = np.nonzero(owner == s)[0]
            out[s][table] = (pos, u[pos])
    return out


def assemble(shape: ctr.CTRShape, answers: Sequence[tuple[dict, dict]], routes, uniq: list[np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's dense tensors and, per table, the rows of the unique ids, put together from
    the shards' answers to pulls (or reads) made along ``routes``."""
    dense = {name: torch.from_numpy(np.concatenate([a[0][name] for a in answers]).reshape(shp)) for name, shp in ctr.dense_shapes(shape).items()}
    tables = {}
    for f, u in enumerate(uniq):
        table = ctr.table_name(f)
        full = np.empty((len(u), shape.embedding_dim), np.float32)
        for s, answer in enumerate(answers):
            full[routes[s][table][0]] = answer[1][table]
        tables[table] = torch.from_numpy(full)
    return dense, tables


@ray.remote
class PSWorker:
    """A worker actor; :meth:`run` does a range of clocks in one call."""

    def __init__(self) -> None:
        self.core: WorkerCore | None = None  # set by setup(): a pool starts workers before it knows their rows
        self.shards: list[Any] = []

    def setup(self, config: WorkerConfig) -> dict[str, Any]:
        """Become worker ``config.index``: read its rows."""
        self.core = WorkerCore(config)
        return self.where()

    def where(self) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def connect(self, shards: list[Any]) -> int:
        self.shards = list(shards)
        return len(self.shards)

    def run(self, first: int, last: int) -> dict[str, Any]:
        """Clocks ``first .. last-1``: pull, compute, push each; returns their losses and
        how long the pulls waited (the consistency mode's cost)."""
        c = self.core.config
        losses, waited = [], 0.0
        for clock in range(first, last):
            ids, numeric, labels = self.core.batch(clock)
            uniq, inv = ctr.unique_ids(ids)
            routes = self.core.route(uniq)
            t0 = time.perf_counter()
            pulled = ray.get([sh.pull.remote(c.index, clock, {t: ids_ for t, (_, ids_) in routes[s].items()}) for s, sh in enumerate(self.shards)], timeout=c.timeout_s)
            waited += time.perf_counter() - t0
            loss, pushes = self.core.compute(clock, pulled, routes, uniq, inv, numeric, labels)
            ray.get([sh.push.remote(c.index, clock, d, sp) for sh, (d, sp) in zip(self.shards, pushes)], timeout=c.timeout_s)
            losses.append(loss)
        return {"losses": losses, "pull_wait_s": waited}
