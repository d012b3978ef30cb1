"""XGBoost trainers: one data shard per actor, joined through xgboost's own collective.

Where it lives: any node with ``nthread`` free CPUs (a stateful role: on-demand nodes first,
unless the job prefers spot). What is copied into it: its slice of the config (a :class:`XGBoostTrainerConfig`:
the table spec, not the data), then one :class:`Shard` through :meth:`XGBoostTrainer.load`,
whose rows it reads itself. The driver never ships rows.

:meth:`XGBoostTrainer.train` streams chunks of boosting rounds from inside one
``xgboost.collective.CommunicatorContext``, with the tracker the driver started for the
group; every trainer of the group must be in the same call. What a failure means: if one
trainer dies mid-chunk, the others leave the collective with an ``XGBoostError`` (their
sockets to the dead peer close), keep their shard in memory, and can join the next group.
Their quantile cuts, though, were agreed with the old group, so every trainer rebuilds its
matrices when the driver starts a new group (a new ``group`` number).

What it listens on: while in the collective, two ports xgboost binds on every interface
(peers, error notice; xgboost has no setting for the address). Links go to the address
the tracker saw each trainer come from, so they stay on loopback when the driver put the
tracker there (:mod:`raylane.jobs.xgboost_collective`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from raylane.actors.tabular import TableSpec, eval_mask, read_rows


@dataclass(frozen=True)
class XGBoostTrainerConfig:
    """The slice of the job a trainer needs: what to read and how to build and train."""

    table: TableSpec
    """Where the rows are; the trainer reads its own range."""
    eval_fraction: float
    """Share of rows held out for evaluation (per row, by hash of its index and ``seed``)."""
    seed: int
    """Seed of the evaluation split."""
    nthread: int
    """Threads for matrix building and boosting (also the CPUs the actor reserves)."""
    quantile: bool = True
    """Build a ``QuantileDMatrix`` (the ``hist`` method); False: a plain ``DMatrix`` (``approx``)."""
    max_bin: int = 256
    """Histogram bins per feature: the matrix's cuts must match the booster's ``max_bin``."""


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of the table, the ``index``-th shard (and collective rank)."""

    index: int
    start: int
    stop: int


@ray.remote
class XGBoostTrainer:
    """Holds one shard (train and eval rows as arrays) and the matrices built from them."""

    def __init__(self, config: XGBoostTrainerConfig):
        # xgboost takes about a second to import (it imports scikit-learn when installed):
        # start now, so it overlaps with reading the shard instead of delaying the first chunk.
        threading.Thread(target=importlib.import_module, args=("xgboost",), name="import-xgboost", daemon=True).start()
        self.config = config
        self.shard: Shard | None = None
        self._train: tuple[np.ndarray, np.ndarray] | None = None
        self._eval: tuple[np.ndarray, np.ndarray] | None = None
        self._matrices: dict[str, Any] = {}
        self._group: int | None = None  # the group whose collective agreed the matrices' cuts
        self.loads = 0

    def where(self) -> dict[str, Any]:
        """Node, process and shard of this trainer."""
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "shard": None if self.shard is None else self.shard.index, "loads": self.loads}

    def load(self, shard: Shard) -> dict[str, Any]:
        """Read rows ``[shard.start, shard.stop)`` and split off the evaluation rows."""
        t0 = time.perf_counter()
        c = self.config
        self.shard, self._train, self._eval, self._matrices, self._group = None, None, None, {}, None
        x, y = read_rows(c.table, shard.start, shard.stop)
        held_out = eval_mask(c.seed, shard.start, shard.stop, c.eval_fraction)
        if held_out.any():
            self._train, self._eval = (x[~held_out], y[~held_out]), (x[held_out], y[held_out])
        else:
            self._train, self._eval = (x, y), (x[:0], y[:0])
        if len(self._train[1]) == 0:
            raise ValueError(f"shard {shard.index} (rows {shard.start}..{shard.stop}) has no training rows after the evaluation split; lower data.eval_fraction or use fewer trainers")
        self.shard = shard
        self.loads += 1
        return {**self.where(), "train_rows": len(self._train[1]), "eval_rows": len(self._eval[1]), "seconds": time.perf_counter() - t0}

    def _build(self, evals: tuple[str, ...]) -> None:
        import xgboost as xgb

        n = self.config.nthread
        x, y = self._train
        names = list(self.config.table.features)
        if any(c in name for name in names for c in "[]<,"):  # characters xgboost refuses in names
            names = None
        types = self.config.table.feature_types
        kw: dict[str, Any] = {"nthread": n, "feature_names": names}
        if types is not None:  # category codes, the same on every trainer (the driver's list)
            kw.update(feature_types=types, enable_categorical=True)
        if self.config.quantile:
            # Inside the collective: the quantile sketch is merged across all trainers here.
            dtrain = xgb.QuantileDMatrix(x, y, max_bin=self.config.max_bin, **kw)
            make_eval = lambda xe, ye: xgb.QuantileDMatrix(xe, ye, ref=dtrain, max_bin=self.config.max_bin, **kw)  # noqa: E731 - the training cuts
        else:
            dtrain = xgb.DMatrix(x, y, **kw)
            make_eval = lambda xe, ye: xgb.DMatrix(xe, ye, **kw)  # noqa: E731
        self._matrices = {"dtrain": dtrain}
        if "train" in evals:
            self._matrices["train"] = dtrain
        if "eval" in evals:
            self._matrices["eval"] = make_eval(*self._eval)

    @ray.method(num_returns="streaming")
    def train(self, comm_args: dict[str, Any], group: int, model: bytes | None, start_round: int, rounds: int, chunk: int, params: dict[str, Any], evals: tuple[str, ...]):
        """Boost rounds ``start_round .. start_round + rounds`` from ``model`` (UBJ bytes) with
        the group, yielding after every ``chunk`` rounds.

        One collective session for the whole stream: the group keeps boosting while the
        driver checkpoints the chunk it just received. Each item holds the round reached,
        that chunk's per-round metrics (already aggregated over the group by xgboost),
        timings, and on rank 0 the model as UBJ bytes.
        """
        import xgboost as xgb
        from xgboost import collective

        if self.shard is None:
            raise RuntimeError("train called before load: this trainer holds no shard")
        with collective.CommunicatorContext(**comm_args, dmlc_task_id=f"{self.shard.index:06d}"):
            build_s = 0.0
            if self._group != group or set(evals) - set(self._matrices):
                self._group = None
                t0 = time.perf_counter()
                self._build(evals)
                build_s = time.perf_counter() - t0
                self._group = group
            watch = [(self._matrices[name], name) for name in evals]
            # One booster for the whole stream, driven round by round as xgboost.train does.
            # xgboost.train per chunk would drop the booster's prediction cache at the end
            # of every call (Booster.reset), and each chunk would start by predicting every
            # tree so far on every row.
            booster = xgb.Booster({**params, "nthread": self.config.nthread}, [self._matrices["dtrain"]] + [m for m, _ in watch], model_file=None if model is None else bytearray(model))
            if booster.num_boosted_rounds() != start_round:
                raise ValueError(f"the model given has {booster.num_boosted_rounds()} rounds, expected {start_round}")
            rank = collective.get_rank()
            done = start_round
            while done < start_round + rounds:
                t0 = time.perf_counter()
                history: dict[str, dict[str, list[float]]] = {}
                for i in range(done, min(done + chunk, start_round + rounds)):
                    booster.update(self._matrices["dtrain"], iteration=i)
                    if watch:
                        # "[i]\ttrain-logloss:0.51\teval-logloss:0.53": already aggregated over the group
                        for entry in booster.eval_set(watch, iteration=i).split()[1:]:
                            key, value = entry.rsplit(":", 1)
                            data, metric = key.split("-", 1)
                            history.setdefault(data, {}).setdefault(metric, []).append(float(value))
                    done = i + 1
                raw = bytes(booster.save_raw("ubj"))
                item = {"shard": self.shard.index, "rank": rank, "round": done, "history": history, "seconds": time.perf_counter() - t0, "build_s": build_s, "model_sha256": hashlib.sha256(raw).hexdigest()}
                if rank == 0:  # every rank holds the same model (the digest proves it); one copy travels
                    item["model"] = raw
                build_s = 0.0
                yield item
