"""``raylane run ps_ctr``: a click-through-rate model trained on parameter shards.

Shards (stateful, on-demand) hold the MLP's tensors as flat ranges and the embedding
rows of every field hashed over them, created on first touch, with the optimizer's
state beside them. Workers (stateless, spot) each read their own rows of generated
click data and loop pull -> forward/backward -> push, one clock per batch, in the chosen
consistency mode (sync, async, ssp with a staleness bound). One driver step is
``clocks_per_step`` clocks of every worker; after it the driver measures the held-out AUC
and, every N steps, checkpoints every shard's slice.

A lost worker is replaced and reads the same rows; the shards keep their state and the
clocks since the checkpoint run again, which the shards ignore (a (worker, clock) is
applied once). A lost shard is replaced and every shard, the survivors too, goes back to
the last checkpoint before those clocks run again (see :meth:`PSCTRWorkload.load_state_dict`),
so a sync run ends bit-identical to one without the loss. The failure names the role
``param_shard`` and the shard's number.

    raylane run ps_ctr
    raylane run ps_ctr --set mode=ssp --set staleness=2 --set shards=4 --set optimizer=adam
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np
import ray
import torch

from raylane import checkpoint_parts
from raylane import config as cfg
from raylane.actors import ctr, ctr_files, ctr_model
from raylane.actors.ctr_files import CTRDataConfig  # noqa: F401 - also raylane.jobs.ps_ctr's
from raylane.actors.param_shard import MAX_WORKERS, MODES, ParamShard, ShardConfig
from raylane.actors.ps_layout import dense_slices
from raylane.actors.ps_optim import OPTIMIZERS
from raylane.actors.ps_worker import PSWorker, WorkerConfig, assemble, route
from raylane.api import BaseWorkload, CallTimeoutError, Context, DriverConfig, Gang, GroupLost, JobSpec, LOST, PoolError, RoleSpec
from raylane.launch import job_main
from raylane.placement import split_by_speed
from raylane.runlog import say

log = logging.getLogger(__name__)

SHARDS, WORKERS = "param_shard", "ps_worker"
T = TypeVar("T")


@dataclass
class PSCTRConfig:
    """Click-through-rate training on a sharded parameter server."""

    data: CTRDataConfig = field(default_factory=CTRDataConfig)
    """Your click table (data.path); generated clicks without one. Its last eval_rows rows are held out."""
    rows: int = cfg.field(200_000, ge=1)
    """Training rows of generated click data (split over the workers)."""
    eval_rows: int = cfg.field(20_000, ge=100)
    """Held-out rows (after the training rows) for the AUC."""
    fields: int = cfg.field(8, ge=1)
    """Categorical fields (one embedding table each)."""
    ids_per_field: int = cfg.field(2, ge=1)
    """Hashed ids per field per row (an embedding bag, averaged)."""
    buckets: int = cfg.field(10_000, ge=1)
    """Hash buckets per field."""
    dense_features: int = cfg.field(8, ge=0)
    """Numeric features per row."""
    embedding_dim: int = cfg.field(8, ge=1)
    """Width of an embedding row."""
    hidden: int = cfg.field(32, ge=1)
    """Units in the MLP's hidden layer."""
    shards: int = cfg.field(2, ge=1)
    """Parameter shards."""
    workers: int = cfg.field(2, ge=1)
    """Workers."""
    mode: str = cfg.field("sync", choices=MODES)
    """sync (every worker's gradient for a clock, averaged, then the next clock), async (applied on arrival) or ssp (async, but no worker more than `staleness` clocks ahead of the slowest)."""
    staleness: int = cfg.field(2, ge=0)
    """ssp: clocks a worker may run ahead of the slowest."""
    optimizer: str = cfg.field("adagrad", choices=OPTIMIZERS)
    """Optimizer on the shards (per-row state for embedding rows; adam's step count is per row)."""
    lr: float = cfg.field(0.05, gt=0)
    """Learning rate."""
    weight_decay: float = cfg.field(0.0, ge=0)
    """L2 regularisation, added to each gradient the shards apply as torch's optimizers add
    it (``grad + weight_decay * value``): the MLP's tensors at every update, an embedding
    row at every update that touches it (rows no batch touches are left as they are)."""
    batch_size: int = cfg.field(512, ge=1)
    """Rows per worker per clock."""
    clocks_per_step: int = cfg.field(20, ge=1)
    """Clocks every worker runs per driver step (checkpoints and the AUC come between steps)."""
    init_scale: float = cfg.field(0.05, gt=0)
    """Embedding rows start uniform in [-init_scale, init_scale)."""
    seed: int = 0
    """Seed of the data, the initial weights and the batch order."""
    target_auc: float = cfg.field(0.0, ge=0, le=1)
    """Stop once the held-out AUC reaches this (0: run all steps)."""
    shard_cpus: float = cfg.field(0.25, gt=0)
    """CPUs each shard reserves."""
    worker_cpus: float = cfg.field(0.5, gt=0)
    """CPUs each worker reserves."""
    wait_timeout_s: float = cfg.field(30.0, gt=0)
    """Longest a pull waits for other workers' clocks (a lost worker shows up as this)."""
    step_timeout_s: float = cfg.field(300.0, gt=0)
    """Longest one step may take."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=15, checkpoint_every_steps=5, keep_best=True))
    """Run name, stop rules, checkpoints. The step of the best held-out AUC is kept (``keep_best``):
    on a sparse click log the model overfits after a few passes while its training loss still falls."""

    def validate(self) -> None:
        if self.workers > MAX_WORKERS:
            raise ValueError(f"workers ({self.workers}) must not exceed {MAX_WORKERS}: each shard holds a thread for every waiting pull")
        if self.workers > self.rows:
            raise ValueError(f"workers ({self.workers}) must not exceed rows ({self.rows}): every worker needs rows")
        if self.mode != "ssp" and self.staleness != PSCTRConfig.staleness:
            log.info("staleness=%s only applies to mode=ssp (mode is %s)", self.staleness, self.mode)
        if self.data.path is not None:
            generated_only = [k for k in ("rows", "fields", "ids_per_field", "dense_features") if getattr(self, k) != getattr(PSCTRConfig, k)]
            if generated_only:
                raise ValueError(f"{', '.join(generated_only)} describe generated data; with data.path the table decides "
                                 "(its rows less eval_rows train, one field per categorical column, one feature per numeric one): drop them")

    def table(self) -> ctr_files.CTRTable | None:
        """The user's click table, checked (schema and labels), or None for generated data."""
        d = self.data
        if d.path is None:
            return None
        table = ctr_files.describe_ctr(d.path, label=d.label, categorical=d.categorical, numeric=d.numeric, fmt=d.format, standardize=d.standardize)
        if table.spec.rows < self.eval_rows + self.workers:
            raise ValueError(f"data.path {d.path!r} has {table.spec.rows} rows; eval_rows ({self.eval_rows}) are held out and each of "
                             f"the {self.workers} workers needs at least one: lower eval_rows or give more rows")
        return table

    def shape(self, table: ctr_files.CTRTable | None = None) -> ctr.CTRShape:
        if table is not None:
            return ctr.CTRShape(len(table.categorical), 1, self.buckets, len(table.numeric), self.embedding_dim, self.hidden)
        return ctr.CTRShape(self.fields, self.ids_per_field, self.buckets, self.dense_features, self.embedding_dim, self.hidden)


def pull_failed(exc: BaseException) -> bool:
    """A worker's error that means a shard it pulls from is gone or a wait timed out (the
    gang's "broken collective": recoverable), not a bug in the worker."""
    return isinstance(exc, LOST + (TimeoutError,)) or isinstance(getattr(exc, "cause", None), LOST + (TimeoutError,))


class ShardLost(PoolError):
    """Parameter shards died (recoverable): ``role`` is ``param_shard`` and ``shards`` their
    numbers, so the driver's failure event names what was lost, not the workers it took down."""

    def __init__(self, shards: list[int], during: str):
        which = f"shard {shards[0]}" if len(shards) == 1 else f"shards {shards}"
        super().__init__(f"parameter {which} lost during {during}; every shard goes back to the last checkpoint")
        self.shards = shards
        self.role, self.actor = SHARDS, ",".join(map(str, shards))


@dataclass(frozen=True)
class CTRData:
    """What the job's prepare read: the user's click table (schema and labels checked), or None for generated rows."""

    table: ctr_files.CTRTable | None


def prepare(c: PSCTRConfig) -> CTRData:
    """The job's prepare: the click table described and checked once, before any actor starts."""
    return CTRData(c.table())


class PSCTRWorkload(BaseWorkload):
    name = "ps_ctr"
    main_metric = "auc"
    guarded_metrics = ("loss", "auc")  # auc is NaN when the held-out scores are not finite
    metrics = ("auc", "loss", "clock", "updates_per_s", "pull_wait_s", "step_s")
    progress_metrics = ("auc", "loss")

    def __init__(self, config: PSCTRConfig, data: CTRData | None = None):
        """``data``: the click table as :func:`prepare` checked it; read here when None."""
        self.config = config
        self.table = (data if data is not None else prepare(config)).table
        self.shape = config.shape(self.table)
        self.shape.check()
        # Budgets, before the held-out rows are made. Per shard: the embedding rows touched
        # (at most buckets per field, hashed evenly over the shards) x (2 x embedding_dim x 4
        # bytes x (1 + optimizer slots): arrays grow by doubling; + 120 for the id -> row dict).
        # Per worker and on the driver: its rows x (fields x ids_per_field x 8 + dense x 4 + 4) x 2 (blocks, then joined).
        from raylane import budget
        from raylane.actors.ps_optim import UpdateRule
        s, n, slots = self.shape, (config.rows if self.table is None else self.table.spec.rows - config.eval_rows), len(UpdateRule(config.optimizer, 1.0).slots())
        emb, row = s.fields * min(s.buckets, (n + config.eval_rows) * s.ids_per_field) / config.shards, (s.fields * s.ids_per_field * 8 + s.dense_features * 4 + 4) * 2
        budget.check(self.name, [budget.Estimate(f"embedding rows: fields ({s.fields}) x buckets ({s.buckets:,}) / shards ({config.shards}) x (2 x embedding_dim ({s.embedding_dim}) "
                                                 f"x 4 bytes x (1 + {slots} {config.optimizer} slots) + 120)", emb * (8 * s.embedding_dim * (1 + slots) + 120), ("buckets", "embedding_dim"), ("shards",))], where="parameter shard")
        budget.check(self.name, [budget.Estimate(f"its rows: {n:,} / workers ({config.workers}) x {row} bytes", n / config.workers * row, ("rows",) if self.table is None else (), ("workers",))], where="worker")
        budget.check(self.name, [budget.Estimate(f"held-out rows: eval_rows ({config.eval_rows:,}) x {row} bytes", config.eval_rows * row, "eval_rows")])
        self.sizes = {n: int(np.prod(s)) for n, s in ctr.dense_shapes(self.shape).items()}
        self.slices = dense_slices(self.sizes, config.shards)
        if self.table is None:
            self.train_rows = config.rows
            self.eval = ctr.rows(self.shape, config.seed, config.rows, config.rows + config.eval_rows)
        else:  # the table's last eval_rows rows are held out
            self.train_rows = self.table.spec.rows - config.eval_rows
            self.eval = ctr_files.read_ctr_rows(self.table, config.buckets, self.train_rows, self.table.spec.rows)
        self.shard_gang: Gang | None = None  # rank i holds shard i
        self.worker_gang: Gang | None = None  # rank w reads worker w's rows
        self.ctx: Context | None = None
        self.fresh: set[int] = set()  # shards holding no trained state (to restore on a load)
        self.auc = 0.5

    # ------------------------------------------------------------ roles and actors

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [RoleSpec(SHARDS, {"CPU": c.shard_cpus}, count=c.shards, stateful=True),
                RoleSpec(WORKERS, {"CPU": c.worker_cpus}, count=c.workers)]

    def shard_config(self, i: int) -> ShardConfig:
        c = self.config
        tables = {ctr.table_name(f): c.embedding_dim for f in range(self.shape.fields)}
        return ShardConfig(i, c.shards, c.workers, dict(self.slices[i]), tables, c.mode, c.staleness, c.optimizer, c.lr, c.init_scale, c.seed, c.wait_timeout_s,
                           weight_decay=c.weight_decay)

    def worker_config(self, w: int, rows: tuple[int, int]) -> WorkerConfig:
        c = self.config
        return WorkerConfig(w, self.shape, rows, c.shards, c.batch_size, c.seed, c.seed, c.step_timeout_s, self.table)

    @property
    def shards(self) -> dict[int, Any]:
        """{shard number: its live actor}."""
        return {} if self.shard_gang is None else self.shard_gang.handles()

    @property
    def workers(self) -> dict[int, Any]:
        """{worker number: its live actor}."""
        return {} if self.worker_gang is None else self.worker_gang.handles()

    def setup(self, ctx: Context) -> None:
        c = self.config
        self.ctx = ctx
        if (t := self.table) is not None:
            self._say_read(t, ctx)
        self.shard_gang = ctx.gang(SHARDS, ParamShard, start_timeout_s=c.step_timeout_s, on_join=self._join_shard, rank_name="shard")
        self.worker_gang = ctx.gang(WORKERS, PSWorker, start_timeout_s=c.step_timeout_s, on_join=self._join_worker, broken=pull_failed, rank_name="worker")
        self._ensure_actors()
        init = ctr.init_dense(self.shape, c.seed)
        flat = {n: v.reshape(-1) for n, v in init.items()}
        self.shard_gang.call("init_dense", timeout_s=c.step_timeout_s, grace_s=c.step_timeout_s,
                             per_rank=lambda i: (({n: flat[n][a:b] for n, (a, b) in self.slices[i].items()},), {}))

    def _say_read(self, t: ctr_files.CTRTable, ctx: Context) -> None:
        """What was read from the user's table, on the terminal and as a ``ctr_data`` event."""
        line, event = ctr_files.read_out(t, self.train_rows, self.config.eval_rows, int(np.count_nonzero(self.eval[2] == 1.0)))
        say(f"ps_ctr: {line}")
        ctx.log.event("ctr_data", **event)

    def _join_shard(self, i: int, shard: Any) -> Any:
        """The shard gang's ``on_join``: shard ``i``'s slices and tables, no trained state yet."""
        self.fresh.add(i)
        return shard.setup.remote(self.shard_config(i))

    def _join_worker(self, w: int, worker: Any) -> Any:
        """The worker gang's ``on_join``: worker ``w`` reads the same rows as any worker ``w`` before it."""
        bounds = np.cumsum([0] + split_by_speed(self.train_rows, [1.0] * self.config.workers)).tolist()
        return worker.setup.remote(self.worker_config(w, (bounds[w], bounds[w + 1])))

    def _ensure_actors(self, shards: bool = True, wait_s: float | None = None) -> None:
        """Every worker number (and, with ``shards``, every shard number) on a live actor;
        new shards are fresh (restored on the load that follows a recovery), survivors keep
        their state. Shards are only replaced on recovery: a shard replaced anywhere else
        would serve without its state."""
        assert self.shard_gang is not None and self.worker_gang is not None and self.ctx is not None
        c = self.config
        wait = wait_s or c.step_timeout_s
        new = self.shard_gang.form(timeout_s=wait) if shards else {}
        new_w = self.worker_gang.form(timeout_s=wait)
        handles = [self.shards[i] for i in range(c.shards)]
        self.worker_gang.call("connect", handles, timeout_s=c.step_timeout_s, grace_s=c.step_timeout_s)
        if new or new_w:
            self.ctx.log.event("ps_actors", new_shards=sorted(new), new_workers=sorted(new_w))

    # ------------------------------------------------------------ steps

    def step(self, step: int) -> dict[str, Any]:
        c = self.config
        first, last = step * c.clocks_per_step, (step + 1) * c.clocks_per_step
        t0 = time.perf_counter()
        try:
            # On the first failure the other workers get 2 s, then are killed (replaced on recovery).
            results = self.worker_gang.call("run", first, last, timeout_s=c.step_timeout_s, grace_s=2.0)
        except (GroupLost, CallTimeoutError) as exc:
            # A dead shard is named as the loss, not the workers whose pulls it failed.
            raise (self._shard_loss(f"step {step}") or exc) from exc
        seconds = time.perf_counter() - t0
        self.fresh.clear()
        losses = [x for r in results.values() for x in r["losses"]]
        loss = float(np.mean(losses))
        # A diverged model has no AUC (sklearn refuses NaN scores): report the loss as it is
        # and let the driver's guard stop the run, naming it and the last good checkpoint.
        auc = self._on_shards(self.evaluate, f"the evaluation after step {step}") if math.isfinite(loss) else math.nan
        if math.isfinite(auc):
            self.auc = auc
        return {"loss": loss, "auc": auc, "clock": last, "updates_per_s": len(losses) / seconds,
                "pull_wait_s": float(np.mean([r["pull_wait_s"] for r in results.values()])), "step_s": seconds}

    def dead_shards(self) -> list[int]:
        """Numbers of the shards whose actor is gone. A shard that does not answer within a
        few seconds counts as alive: a slow shard is a timeout, not a loss."""
        probes = {i: h.where.remote() for i, h in self.shards.items()}
        dead = [] if self.shard_gang is None else self.shard_gang.missing()
        for i, ref in probes.items():
            try:
                ray.get(ref, timeout=5.0)
            except LOST:
                dead.append(i)
            except Exception:  # noqa: BLE001 - a timeout or any other answer: not lost
                pass
        return sorted(dead)

    def _shard_loss(self, during: str) -> ShardLost | None:
        """A :class:`ShardLost` (and its own event) when shards are dead, else None."""
        dead = self.dead_shards()
        if not dead:
            return None
        if self.ctx is not None:
            self.ctx.log.event("ps_lost", role=SHARDS, shards=dead, during=during)
        return ShardLost(dead, during)

    def _on_shards(self, fn: Callable[[], T], during: str) -> T:
        """``fn()``; a lost actor under it is a :class:`ShardLost` naming the dead shards."""
        try:
            return fn()
        except LOST as exc:
            raise (self._shard_loss(during) or exc) from exc

    def evaluate(self) -> float:
        """The held-out AUC of the model as the shards hold it now."""
        from sklearn.metrics import roc_auc_score

        c = self.config
        ids, numeric, labels = self.eval
        uniq, inv = ctr.unique_ids(ids)
        routes = route(uniq, c.shards)
        answers = ray.get([self.shards[s].read.remote({t: ids_ for t, (_, ids_) in routes[s].items()}) for s in range(c.shards)], timeout=c.step_timeout_s)
        dense, tables = assemble(self.shape, answers, routes, uniq)
        with torch.no_grad():
            logits = ctr.forward(self.shape, dense, tables, inv, torch.from_numpy(numeric)).numpy()
        if not np.isfinite(logits).all():  # NaN for the driver's guard, not sklearn's ValueError
            log.warning("ps_ctr: %d of %d held-out scores are not finite; the AUC is NaN", int((~np.isfinite(logits)).sum()), len(logits))
            return math.nan
        return float(roc_auc_score(labels, logits))

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        c = self.config
        # Each shard snapshots its state and writes it itself (the driver never holds it).
        parts = self._on_shards(lambda: checkpoint_parts.snapshot({str(i): self.shards[i] for i in range(c.shards)}, timeout_s=c.step_timeout_s), "a checkpoint")
        return {"shards": parts, "auc": self.auc, "model": self.about()}

    def about(self) -> dict[str, Any]:
        """What rebuilds the model outside raylane (:mod:`raylane.actors.ctr_model`): its
        shape, and for a user's table the columns, in field order, and their scaling."""
        s, t = self.shape, self.table
        inputs = None if t is None else {"categorical": list(t.categorical), "numeric": list(t.numeric), "scale": [list(x) for x in t.scale], "label": t.spec.label,
                                         "hashed_as": list(t.hashed_as)}
        c = self.config
        return {"fields": s.fields, "ids_per_field": s.ids_per_field, "dense_features": s.dense_features, "buckets": s.buckets,
                "embedding_dim": s.embedding_dim, "hidden": s.hidden, "seed": c.seed, "init_scale": c.init_scale, "inputs": inputs}

    def load_state_dict(self, state: dict) -> None:
        """Restore the shards from ``state``: none after a lost worker (they keep what they
        have and ignore the clocks run again), all of them on a resume, and all of them
        after a lost shard, the survivors too.

        Why the survivors too: restored alone, the new shard would replay the clocks since
        the checkpoint against survivors that had already applied them, pulling values
        from later clocks; its slice would end trained on a model no run ever held (a
        different final AUC). Rolled back together, the replay pulls exactly what the first
        pass pulled, so a sync run ends bit-identical and async and ssp runs end as if
        resumed from the checkpoint. Cost: no memory on the shards (the alternative, each
        survivor keeping the values it served since the checkpoint, holds a pull's dense
        slice and rows per worker per clock); no extra computing (the workers run the
        clocks since the checkpoint again either way); the only extra is sending each
        survivor its slice of the checkpoint, the whole model once per shard loss, which the
        driver has already read from the store.

        A lost worker can leave the same hazard in sync mode: lost between its pushes of one
        clock to two shards, it leaves that clock applied on some shards and not on others,
        and the replay would compute that clock's gradient on the mixed model. So when the
        shards' applied clocks differ after a lost worker, they all go back too."""
        c = self.config
        saved = state.get("shards", {})
        if saved and len(saved) != c.shards:  # a checkpoint of another shard count: re-cut onto this one
            parts = [saved[str(j)] for j in range(len(saved))]
            ray.get([self.shards[i].load_resharded.remote(parts, self.sizes) for i in range(c.shards)], timeout=c.step_timeout_s)
            self.fresh.clear()
            self.auc = float(state.get("auc", 0.5))
            if self.ctx is not None:
                self.ctx.log.event("ps_reshard", role=SHARDS, saved_shards=len(saved), shards=c.shards)
            say(f"ps_ctr: the checkpoint holds {len(saved)} shards; re-cut onto {c.shards} (dense ranges and embedding rows moved to their new shards)")
            return
        lost = sorted(self.fresh)
        split = {} if lost or c.mode != "sync" or not state.get("shards") else self._applied_clocks()
        todo = list(range(c.shards)) if lost or len(set(split.values())) > 1 else []
        # Each shard reads its own part (checked against the manifest); older checkpoints hold the state itself.
        ray.get([self.shards[i].load_part.remote(state["shards"][str(i)]) for i in todo], timeout=c.step_timeout_s)
        self.fresh.clear()
        self.auc = float(state.get("auc", 0.5))
        if self.ctx is not None and todo:
            self.ctx.log.event("ps_restore", role=SHARDS, shards=todo, replaced=lost, **({"applied_clocks": split} if not lost else {}))

    def _applied_clocks(self) -> dict[str, int]:
        """{shard: clocks applied} in sync mode."""
        stats = ray.get([self.shards[i].stats.remote() for i in range(self.config.shards)], timeout=self.config.step_timeout_s)
        return {str(i): int(s["next_clock"]) for i, s in enumerate(stats)}

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return self.config.target_auc > 0 and metrics["auc"] >= self.config.target_auc

    def on_event(self, event: Any) -> bool:
        """A node is leaving or gone: the driver has evacuated (notice) or evicted (loss) its
        actors; give the workers' numbers to their replacements now, so the next step does not
        fail on a dead worker. (A lost shard fails the next step and is restored on recovery.)"""
        from raylane.preemption import NodeLeaving, NodeLost

        if isinstance(event, (NodeLeaving, NodeLost)) and self.shard_gang is not None:
            try:
                self._ensure_actors(shards=False, wait_s=30.0)
            except (PoolError, TimeoutError) as exc:  # no room yet: the next step fails over to recovery
                log.warning("ps_ctr: could not replace actors after %s: %s", type(event).__name__, exc)
        return False

    def recover(self, ctx: Context, error: BaseException) -> None:
        """Replace what was lost (workers still inside a failed step were killed by the gang:
        stateless, their replacements read the same rows); dead shards are replaced and marked
        for restore from the checkpoint the driver loads next."""
        self.ctx = ctx
        self._ensure_actors()


JOB = JobSpec("ps_ctr", "A click-through-rate model on a sharded parameter server: sync, async or bounded-staleness workers, sparse embedding rows, shard-level recovery.", PSCTRConfig, PSCTRWorkload,
              prepare=prepare, export=ctr_model.export, load_model=ctr_model.load)

if __name__ == "__main__":
    job_main(JOB)
