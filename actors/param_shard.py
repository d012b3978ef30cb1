"""Parameter shards: one slice of the dense parameters and of every embedding table, with
the optimizer that updates them, behind pull and push.

Where it lives: a stateful role (on-demand nodes first). What is copied into it: its
:class:`ShardConfig` slice, then the initial values of its dense ranges
(:meth:`ShardCore.init_dense`) or, on a restore, its checkpointed state
(:meth:`ShardCore.import_state`). Embedding rows are created on first touch from
:func:`raylane.actors.ps_layout.init_rows`, so they start the same on any shard.

Consistency (``mode``):

* ``sync``: the update of clock ``c`` is applied once every worker's push for ``c`` has
  arrived (gradients averaged over workers), clocks in order; a pull for clock ``c``
  waits until clocks ``< c`` are applied: bulk-synchronous SGD.
* ``async``: a push is applied on arrival; a pull never waits.
* ``ssp``: applied on arrival, but a pull for clock ``c`` waits while ``c`` is more than
  ``staleness`` clocks ahead of the slowest worker (stale synchronous parallel).

A push is applied once per (worker, clock), however often it arrives: Ray retries actor
calls at least once, and a job recovered from a lost worker replays the clocks since its
checkpoint, which the shards have already applied. Every served pull is logged with the slowest
worker's clock at that moment, so the staleness bound can be checked afterwards.

What a failure means: a lost shard takes the updates to its slice since the last
checkpoint with it. The job (``raylane.jobs.ps_ctr``) then puts every shard back to that
checkpoint, the replacement and the survivors alike, and the clocks since run again; in
sync mode the run ends bit-identical to one without the loss. The count of applied
updates is part of the state, so it says how many updates the model holds.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import ray

from raylane.actors.ps_layout import check_ids, init_rows
from raylane.actors.ps_reshard import reshard
from raylane.checkpoint_format import StoredPart
from raylane.checkpoint_parts import CHECKPOINT_GROUPS, CheckpointParts, read_part
from raylane.actors.ps_optim import OPTIMIZERS, UpdateRule

MODES = ("sync", "async", "ssp")
LOG_LIMIT = 100_000  # served pulls kept for checking the staleness bound
MAX_WORKERS = 64  # threads for waiting pulls per shard (ParamShard's "wait" group)


@dataclass(frozen=True)
class ShardConfig:
    """One shard's slice of the job's config."""

    index: int
    """This shard's number, 0 .. shards-1."""
    shards: int
    """Shards in the job."""
    workers: int
    """Workers pushing to it (sync waits for all of them)."""
    dense: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Its flat range of each dense tensor: name -> (start, stop)."""
    tables: Mapping[str, int] = field(default_factory=dict)
    """Embedding tables: name -> row width."""
    mode: str = "sync"
    """sync, async or ssp."""
    staleness: int = 0
    """ssp: how many clocks a worker may run ahead of the slowest."""
    optimizer: str = "adagrad"
    """sgd, adagrad or adam (per-row state and step count for embedding rows)."""
    lr: float = 0.05
    """Learning rate."""
    init_scale: float = 0.05
    """Embedding rows start uniform in [-init_scale, init_scale)."""
    seed: int = 0
    """Seed of the embedding rows' initial values."""
    wait_timeout_s: float = 60.0
    """Longest a pull waits for other workers' clocks before it fails."""
    weight_decay: float = 0.0
    """L2 added to every gradient applied (``grad + weight_decay * value``): the dense
    tensors at every update, an embedding row at every update that touches it."""

    def __post_init__(self) -> None:
        check_config(self)


def check_config(c: ShardConfig) -> None:
    if c.mode not in MODES:
        raise ValueError(f"mode {c.mode!r} is not one of {', '.join(MODES)}")
    if c.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {c.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if isinstance(c.staleness, bool) or not isinstance(c.staleness, int) or c.staleness < 0:
        raise ValueError(f"staleness must be a whole number >= 0, got {c.staleness!r}")
    if c.workers < 1 or c.shards < 1 or not 0 <= c.index < c.shards:
        raise ValueError(f"shard {c.index} of {c.shards} with {c.workers} workers: need workers >= 1 and 0 <= index < shards")
    if c.workers > MAX_WORKERS:
        raise ValueError(f"{c.workers} workers: a shard serves at most {MAX_WORKERS} (its waiting pulls each hold one of {MAX_WORKERS} threads)")
    for name, dim in c.tables.items():
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"table {name!r}: embedding dim must be a whole number >= 1, got {dim!r}")
    if not c.lr > 0:
        raise ValueError(f"lr must be > 0, got {c.lr}")
    if not c.weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {c.weight_decay}")


class _Table:
    """The rows of one embedding table held by one shard: id -> position in growable arrays."""

    def __init__(self, name: str, dim: int, slots: tuple[str, ...]):
        self.name, self.dim = name, dim
        self.pos: dict[int, int] = {}
        self.ids = np.zeros(0, dtype=np.int64)
        self.values = np.zeros((0, dim), dtype=np.float32)
        self.state = {s: np.zeros((0, dim), dtype=np.float32) for s in slots}
        self.steps = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.pos)

    def _grow(self, need: int) -> None:
        cap = len(self.values)
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        pad = new - cap
        self.values = np.concatenate([self.values, np.zeros((pad, self.dim), np.float32)])
        self.ids = np.concatenate([self.ids, np.zeros(pad, np.int64)])
        self.steps = np.concatenate([self.steps, np.zeros(pad, np.int64)])
        self.state = {k: np.concatenate([v, np.zeros((pad, self.dim), np.float32)]) for k, v in self.state.items()}

    def positions(self, ids: np.ndarray, seed: int, scale: float, create: bool) -> np.ndarray:
        """Positions of ``ids``; missing rows are created (``create``) or -1."""
        get = self.pos.get
        pos = np.array([get(i, -1) for i in ids.tolist()], dtype=np.int64)  # a dict: rows arrive in any order, any id
        if create:
            missing = np.unique(ids[pos < 0])
            if len(missing):
                start = len(self.pos)
                self._grow(start + len(missing))
                self.values[start:start + len(missing)] = init_rows(seed, self.name, missing, self.dim, scale)
                self.ids[start:start + len(missing)] = missing
                for k, i in enumerate(missing.tolist()):
                    self.pos[i] = start + k
                pos = np.array([self.pos[i] for i in ids.tolist()], dtype=np.int64)
        return pos

    def export(self) -> dict[str, Any]:
        n = len(self.pos)
        return {"ids": self.ids[:n].copy(), "values": self.values[:n].copy(), "steps": self.steps[:n].copy(), **{f"state_{k}": v[:n].copy() for k, v in self.state.items()}}

    def load(self, saved: Mapping[str, Any]) -> None:
        ids = np.asarray(saved["ids"], dtype=np.int64)
        n = len(ids)
        self.pos = {int(i): k for k, i in enumerate(ids.tolist())}
        self.ids, self.values, self.steps = ids.copy(), np.asarray(saved["values"], np.float32).reshape(n, self.dim).copy(), np.asarray(saved["steps"], np.int64).copy()
        self.state = {k: np.asarray(saved[f"state_{k}"], np.float32).reshape(n, self.dim).copy() for k in self.state}


class ShardCore:
    """A shard without Ray: state, updates, clocks. :class:`ParamShard` adds the waits."""

    def __init__(self, config: ShardConfig):
        self.config = config
        self.opt = UpdateRule(config.optimizer, config.lr, config.weight_decay)
        self.dense: dict[str, np.ndarray] = {n: np.zeros(b - a, np.float32) for n, (a, b) in config.dense.items()}
        self.dense_state = {n: {s: np.zeros(b - a, np.float32) for s in self.opt.slots()} for n, (a, b) in config.dense.items()}
        self.dense_steps = 0
        self.tables = {n: _Table(n, d, self.opt.slots()) for n, d in config.tables.items()}
        # async, ssp: per worker, every clock below done[w] is applied, plus those in above[w]
        # (workers push in order, so `above` stays small; a record per clock would grow forever)
        self.done: dict[int, int] = {w: 0 for w in range(config.workers)}
        self.above: dict[int, set[int]] = {w: set() for w in range(config.workers)}
        self.next_clock = 0  # sync: clocks < next_clock are applied
        self.pending: dict[int, dict[int, tuple]] = {}  # sync: clock -> worker -> push
        self.log: list[tuple[int, int, int]] = []  # served pulls: (worker, clock, slowest worker's clock)
        self.duplicates = 0
        self.updates = 0

    # ------------------------------------------------------------ clocks

    def worker_clock(self, w: int) -> int:
        """Clocks worker ``w`` has completed here."""
        if self.config.mode == "sync":
            return self.next_clock + (1 if w in self.pending.get(self.next_clock, {}) else 0)
        return max(self.above[w]) + 1 if self.above[w] else self.done[w]

    def slowest(self) -> int:
        return min(self.worker_clock(w) for w in range(self.config.workers))

    def may_serve(self, clock: int) -> bool:
        c = self.config
        if c.mode == "async":
            return True
        if c.mode == "sync":
            return self.next_clock >= clock
        return clock - self.slowest() <= c.staleness

    # ------------------------------------------------------------ pull and push

    def init_dense(self, values: Mapping[str, np.ndarray]) -> None:
        """This shard's ranges of the initial dense tensors (``values[name]`` is the slice)."""
        for n, (a, b) in self.config.dense.items():
            v = np.asarray(values[n], dtype=np.float32).reshape(-1)
            if len(v) != b - a:
                raise ValueError(f"dense {n!r}: shard {self.config.index} holds {b - a} values, got {len(v)}")
            self.dense[n] = v.copy()

    def read(self, ids: Mapping[str, Any], *, create: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The dense ranges and the rows ``ids[table]`` (in that order; rows never touched
        come back at their initial values, stored only with ``create``)."""
        c = self.config
        rows = {}
        for table, raw in ids.items():
            if table not in self.tables:
                raise KeyError(f"no embedding table {table!r} on shard {c.index}; tables: {sorted(self.tables)}")
            arr = check_ids(table, raw)
            t = self.tables[table]
            pos = t.positions(arr, c.seed, c.init_scale, create)
            out = np.empty((len(arr), t.dim), np.float32)
            known = pos >= 0
            out[known] = t.values[pos[known]]
            if not known.all():
                out[~known] = init_rows(c.seed, table, arr[~known], t.dim, c.init_scale)
            rows[table] = out
        return {n: v.copy() for n, v in self.dense.items()}, rows

    def pull(self, worker: int, clock: int, ids: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if len(self.log) >= LOG_LIMIT:  # the newest entries are the ones worth checking
            del self.log[: LOG_LIMIT // 2]
        self.log.append((int(worker), int(clock), self.slowest()))
        return self.read(ids, create=True)

    def push(self, worker: int, clock: int, dense: Mapping[str, np.ndarray], sparse: Mapping[str, tuple[Any, np.ndarray]]) -> bool:
        """Apply (or, in sync mode, hold until the clock is complete) worker ``worker``'s
        gradients for ``clock``. False when this (worker, clock) was seen before."""
        c = self.config
        if not 0 <= worker < c.workers:
            raise ValueError(f"worker {worker} is outside 0..{c.workers - 1}")
        self._check_push(worker, clock, dense, sparse)
        if c.mode == "sync":
            if clock < self.next_clock or worker in self.pending.get(clock, {}):
                self.duplicates += 1
                return False
            self.pending.setdefault(clock, {})[worker] = (dense, sparse)
            while len(self.pending.get(self.next_clock, {})) == c.workers:
                pushes = self.pending.pop(self.next_clock)
                # summed in worker order, not arrival order: float sums of three or more
                # gradients depend on the order, and a replayed clock must give the same bits
                self._apply_mean([pushes[w] for w in sorted(pushes)])
                self.next_clock += 1
            return True
        if clock < self.done[worker] or clock in self.above[worker]:
            self.duplicates += 1
            return False
        self._apply_mean([(dense, sparse)])
        self.above[worker].add(clock)
        while self.done[worker] in self.above[worker]:
            self.above[worker].discard(self.done[worker])
            self.done[worker] += 1
        return True

    def _check_push(self, worker: int, clock: int, dense: Mapping[str, Any], sparse: Mapping[str, tuple[Any, Any]]) -> None:
        """Refuse a malformed push before anything changes (a half-applied update, or a sync
        clock holding a push that cannot be applied, would be worse than the error)."""
        where = f"shard {self.config.index}: push of worker {worker} for clock {clock}"
        for name, value in self.dense.items():
            if name not in dense:
                raise ValueError(f"{where} has no gradient for dense {name!r}; expected {sorted(self.dense)}")
            got = np.asarray(dense[name]).size
            if got != len(value):
                raise ValueError(f"{where}: dense {name!r} gradient has {got} values, this shard holds {len(value)}")
        for table, (ids, grads) in sparse.items():
            if table not in self.tables:
                raise ValueError(f"{where}: no embedding table {table!r}; tables: {sorted(self.tables)}")
            arr = check_ids(table, ids)
            g = np.asarray(grads)
            if g.shape != (len(arr), self.tables[table].dim):
                raise ValueError(f"{where}: table {table!r} gradients are {g.shape}, expected ({len(arr)}, {self.tables[table].dim}) for {len(arr)} ids")

    def _apply_mean(self, pushes: list[tuple]) -> None:
        n = np.float32(len(pushes))
        self.dense_steps += 1
        for name, value in self.dense.items():
            if not len(value):
                continue
            grad = np.asarray(pushes[0][0][name], np.float32).reshape(-1)
            if len(pushes) > 1:
                grad = sum(np.asarray(p[0][name], np.float32).reshape(-1) for p in pushes) / n
            self.opt.update(value, grad, self.dense_state[name], self.dense_steps)
        for table, t in self.tables.items():
            parts = [p[1][table] for p in pushes if table in p[1]]
            if not parts:
                continue
            ids = np.concatenate([check_ids(table, i) for i, _ in parts])
            grads = np.concatenate([np.asarray(g, np.float32).reshape(-1, t.dim) for _, g in parts])
            uniq, inv = np.unique(ids, return_inverse=True)
            if len(uniq) == len(ids):  # the usual case (a worker sends each row once): no summing needed
                total = np.empty_like(grads)
                total[inv] = grads
            else:
                total = np.zeros((len(uniq), t.dim), np.float32)
                np.add.at(total, inv, grads)
            if n != 1:
                total /= n
            pos = t.positions(uniq, self.config.seed, self.config.init_scale, True)
            t.steps[pos] += 1
            vals = t.values[pos]
            state = {k: v[pos] for k, v in t.state.items()}
            self.opt.update(vals, total, state, t.steps[pos])
            t.values[pos] = vals
            for k, v in state.items():
                t.state[k][pos] = v
        self.updates += 1

    # ------------------------------------------------------------ state

    def export_state(self) -> dict[str, Any]:
        """Everything a replacement needs, as arrays and plain data (no code on load)."""
        return {
            "dense": {n: v.copy() for n, v in self.dense.items()},
            "dense_state": {n: {k: v.copy() for k, v in s.items()} for n, s in self.dense_state.items()},
            "dense_steps": self.dense_steps,
            "tables": {n: t.export() for n, t in self.tables.items()},
            "done": {str(w): d for w, d in self.done.items()},
            "above": {str(w): sorted(a) for w, a in self.above.items()},
            "next_clock": self.next_clock,
            "updates": self.updates,
        }

    def import_state(self, state: Mapping[str, Any]) -> None:
        for n in self.dense:
            self.dense[n] = np.asarray(state["dense"][n], np.float32).copy()
            self.dense_state[n] = {k: np.asarray(v, np.float32).copy() for k, v in state["dense_state"][n].items()}
        self.dense_steps = int(state["dense_steps"])
        for n, t in self.tables.items():
            t.load(state["tables"][n])
        self.done = {w: int(state["done"].get(str(w), 0)) for w in range(self.config.workers)}
        self.above = {w: {int(x) for x in state["above"].get(str(w), [])} for w in range(self.config.workers)}
        self.next_clock = int(state["next_clock"])
        self.updates = int(state.get("updates", 0))  # checkpoints written before it was saved lack it
        self.pending = {}

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rows": {n: len(t) for n, t in self.tables.items()}, "updates": self.updates,
                "duplicates": self.duplicates, "next_clock": self.next_clock, "slowest": self.slowest()}


@ray.remote(concurrency_groups={"wait": MAX_WORKERS, "update": 1, **CHECKPOINT_GROUPS})
class ParamShard(CheckpointParts):
    """The shard as an actor. Pulls run in their own group of threads, so a pull that must
    wait for other workers' clocks waits without holding up the pushes that will let it go
    on; pushes and restores run one at a time in theirs; one lock guards the state. (Threads,
    not asyncio: an async actor cost ~1 ms more per call here, a fifth of a round trip.)
    Up to 64 pulls can wait at once, so up to 64 workers per shard. A checkpoint is the
    shard's own part (:mod:`raylane.checkpoint_parts`): a snapshot under the lock, written
    in its own thread while pulls and pushes go on."""

    def __init__(self) -> None:
        self.core: ShardCore | None = None  # set by setup(): a pool starts shards before it knows their numbers
        self.cond = threading.Condition()

    def setup(self, config: ShardConfig) -> dict[str, Any]:
        """Become shard ``config.index`` (fresh: no rows, dense zeros until init_dense or import_state)."""
        with self.cond:
            self.core = ShardCore(config)
        return self.where()

    def where(self) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def init_dense(self, values: Mapping[str, np.ndarray]) -> None:
        with self.cond:
            self.core.init_dense(values)

    @ray.method(concurrency_group="wait")
    def pull(self, worker: int, clock: int, ids: Mapping[str, Any]) -> tuple[dict, dict]:
        core = self.core
        timeout = core.config.wait_timeout_s
        with self.cond:
            if not self.cond.wait_for(lambda: core.may_serve(clock), timeout=timeout):
                raise TimeoutError(f"shard {core.config.index}: worker {worker}'s pull for clock {clock} waited {timeout:g} s; "
                                   f"the slowest worker is at clock {core.slowest()} (mode {core.config.mode}, staleness {core.config.staleness}): a worker lost?")
            return core.pull(worker, clock, ids)

    def read(self, ids: Mapping[str, Any]) -> tuple[dict, dict]:
        with self.cond:
            return self.core.read(ids, create=False)

    @ray.method(concurrency_group="update")
    def push(self, worker: int, clock: int, dense: Mapping[str, np.ndarray], sparse: Mapping[str, tuple[Any, np.ndarray]]) -> bool:
        with self.cond:
            fresh = self.core.push(worker, clock, dense, sparse)
            self.cond.notify_all()
            return fresh

    def export_state(self) -> dict[str, Any]:
        with self.cond:
            return self.core.export_state()

    @ray.method(concurrency_group="update")
    def import_state(self, state: Mapping[str, Any]) -> None:
        with self.cond:
            self.core.import_state(state)
            self.cond.notify_all()

    @ray.method(concurrency_group="update")
    def load_resharded(self, saved: list, sizes: Mapping[str, int]) -> None:
        """Restore this shard from a checkpoint of ``len(saved)`` shards (their parts, or
        their states given whole), re-cut for the shard count it runs with: each old part
        read here, one at a time (see :mod:`raylane.actors.ps_reshard`)."""
        c = self.core.config
        old = ((j, read_part(p) if isinstance(p, StoredPart) else p) for j, p in enumerate(saved))
        state = reshard(old, len(saved), c.index, c.shards, sizes)
        with self.cond:
            self.core.import_state(state)
            self.cond.notify_all()

    def clock_log(self) -> list[tuple[int, int, int]]:
        with self.cond:
            return list(self.core.log)

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return self.core.stats()
