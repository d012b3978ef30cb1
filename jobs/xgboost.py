"""``raylane run xgboost``: data-sharded gradient boosting that survives a lost trainer.

Each trainer reads one shard of the rows itself (sizes in proportion to its node's speed)
and the group boosts through xgboost's collective, with the tracker in this process (on
127.0.0.1 when every trainer is on this node: :mod:`raylane.jobs.xgboost_collective`).
One driver step is one chunk of ``checkpoint_every`` rounds; after each chunk the model
(UBJ bytes), the round and the metric history go to the checkpoint store. The trainers
stream their chunks from one collective session, so they boost the next chunk while the
driver checkpoints the last one. Per-round metrics go to ``rounds.jsonl`` in the run folder
(the last row for a round counts, should a resumed run repeat one), the final model to
``model.ubj``.

When a trainer dies mid-chunk the collective cannot go on: the survivors leave it with an
error (or are killed if they have not within the collective timeout), the trainers' gang
(:class:`raylane.group.Gang`, one rank per shard) replaces the dead trainer, the replacement
takes the lost rank and reads its shard, survivors keep theirs, and the group continues
from the last checkpointed round.

The params are settled on the driver before Ray starts (:mod:`raylane.jobs.xgboost_params`):
a name xgboost does not know is refused, and without an objective one is chosen from the
labels; the run's first line and its ``xgboost_objective`` event say which, and why.

    raylane run xgboost --set data.source=sklearn:breast_cancer --set num_boost_round=50
    python -m raylane.jobs.xgboost --set data.rows=1000000 --set trainers=2 --set threads=1
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import ObjectRefGenerator

from raylane import config as cfg
from raylane.actors import tabular
from raylane.actors.xgboost_trainer import Shard, XGBoostTrainerConfig, XGBoostTrainer
from raylane.api import BaseWorkload, Context, DriverConfig, Gang, JobSpec, RoleSpec
from raylane.prepare import derive
from raylane.jobs.xgboost_collective import Tracker, first_line, is_collective_error, tracker_host
from raylane.jobs.xgboost_params import OBJECTIVES, ObjectiveChoice, objective_params, probe, static_params  # noqa: F401 - OBJECTIVES is re-exported
from raylane.launch import job_main
from raylane.placement import split_by_speed

log = logging.getLogger(__name__)

ROLE = "xgboost_trainer"


@dataclass
class DataConfig:
    """Where the rows come from and which columns are what."""

    source: str = "synthetic:classification"
    """A Parquet or CSV file or folder (local path or pyarrow URI, e.g. s3://bucket/train/); sklearn:<name> for a dataset bundled with scikit-learn (breast_cancer, diabetes, digits, iris, wine); or synthetic:classification / synthetic:regression for rows generated on each trainer."""
    label: str = ""
    """Label column. Empty: 'target' for sklearn datasets, 'label' for synthetic data; required for files."""
    features: list[str] = cfg.field([])
    """Feature columns. Empty: every column but the label (and those in drop)."""
    drop: list[str] = cfg.field([])
    """Columns to leave out (ids, free text, timestamps), when features is empty."""
    categorical: list[str] = cfg.field([])
    """Numeric feature columns to treat as categories (codes, zip codes). String columns of a
    file source are categorical already: xgboost splits on sets of their values
    (enable_categorical), the categories read over the whole source before training."""
    format: str = cfg.field("auto", choices=("auto", "parquet", "csv"))
    """File format; auto reads it from the extension (.parquet, .pq, .csv)."""
    rows: int = cfg.field(100_000, ge=1)
    """Rows to generate (synthetic sources only)."""
    num_features: int = cfg.field(28, ge=1)
    """Features to generate (synthetic sources only)."""
    seed: int = 0
    """Seed of the generated rows and of the evaluation split."""
    eval_fraction: float = cfg.field(0.2, ge=0.0, lt=1.0)
    """Share of rows held out as the evaluation set, picked per row by a hash of its index and the seed (the same rows whatever the trainer count); 0: no evaluation set."""


@dataclass
class XGBoostJobConfig:
    """Distributed XGBoost: one data shard per trainer, joined through xgboost's collective."""

    data: DataConfig = field(default_factory=DataConfig)
    """What to train on."""
    params: dict[str, Any] = cfg.field({})
    """xgboost parameters, passed through to xgboost.train over tree_method=hist, max_depth=6, eta=0.3, seed=0; a name the installed xgboost does not know is refused, with the nearest valid ones. objective, when not given, is chosen from the labels: binary:logistic when every label is 0 or 1; multi:softprob with num_class=k when the labels are exactly the whole numbers 0..k-1, each present, k <= 100 (or when num_class is given); else reg:squarederror, also for whole numbers that are not 0..k-1 (counts, years, ratings 1..5: recode them as 0..k-1 for classes, or set objective, e.g. count:poisson). The choice and its reason are printed as the run starts and logged as the xgboost_objective event. A given objective must fit the labels; multi:* get num_class from the labels. eval_metric: logloss+auc (binary), mlogloss+merror (multi), rmse (regression)."""
    num_boost_round: int = cfg.field(100, ge=1)
    """Boosting rounds in all."""
    trainers: int = cfg.field(2, ge=1)
    """Trainer actors, one data shard each."""
    threads: int = cfg.field(1, ge=1)
    """Threads per trainer (xgboost nthread); each trainer reserves this many CPUs."""
    checkpoint_every: int = cfg.field(10, ge=1)
    """Rounds per chunk: the model is checkpointed after each chunk, and a lost trainer costs at most one chunk."""
    eval_train: bool = True
    """Also compute the metrics on the training rows each round (a pass over them; auc also sorts)."""
    prefer_spot: bool = False
    """Place trainers on spot nodes first (cheaper; a preemption costs at most one chunk). Default: on-demand first, as a stateful role."""
    load_timeout_s: float = cfg.field(600.0, gt=0)
    """Longest a trainer may take to start and read its shard."""
    chunk_timeout_s: float = cfg.field(3600.0, gt=0)
    """Longest one chunk of rounds may take; then the trainers still in it are killed and the group restarts from the last checkpoint."""
    collective_timeout_s: int = cfg.field(120, ge=1)
    """Seconds the collective waits for a peer (group start, each operation); survivors of a lost trainer still inside after this are killed."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=10, checkpoint_every_steps=1))
    """Run name, folder, resume. Derived here: driver.max_steps = ceil(num_boost_round / checkpoint_every) and driver.checkpoint_every_steps = 1 (a step is a chunk)."""

    def validate(self) -> None:
        # A step is a chunk of checkpoint_every rounds, so the step budget and the checkpoint
        # cadence follow from the rounds (derived()); a different value set for them is refused, not overwritten.
        plain = DriverConfig()  # a DriverConfig built in code, left at its own defaults, counts as unset too
        for key, (derived, why) in self.derived().items():
            value = getattr(self.driver, key.split(".")[1])
            defaults, how = ((10, plain.max_steps), "set num_boost_round (and checkpoint_every) instead") if key == "driver.max_steps" else \
                ((1, plain.checkpoint_every_steps), "set checkpoint_every (rounds) instead")
            if value != derived and value not in defaults:
                raise ValueError(f"{key}={value} does not apply to xgboost: it is {derived} here ({why}); {how}")

    def derived(self) -> dict[str, tuple[Any, str]]:
        """The driver settings that follow from the rounds (applied and said by :mod:`raylane.prepare`)."""
        steps = math.ceil(self.num_boost_round / self.checkpoint_every)
        chunk = f"one step is a chunk of checkpoint_every={self.checkpoint_every} rounds"
        return {"driver.max_steps": (steps, f"num_boost_round={self.num_boost_round}: {chunk}"), "driver.checkpoint_every_steps": (1, chunk)}


@dataclass(frozen=True)
class Prepared:
    """What the driver's peek settled: the table, the full xgboost params, the metric names,
    and the objective with why it was chosen."""

    table: tabular.TableSpec
    params: dict[str, Any]
    evals: tuple[str, ...]
    metrics: tuple[str, ...]
    quantile: bool
    objective: ObjectiveChoice


def prepare(c: XGBoostJobConfig) -> Prepared:
    """The job's prepare: check the config against the data (schema, labels, row count) and
    settle the params, once, before Ray starts."""
    params = static_params(c.params)  # names and objective, before the data is read
    d = c.data
    table, labels = tabular.describe(d.source, label=d.label, features=d.features, fmt=d.format, rows=d.rows, num_features=d.num_features, seed=d.seed,
                                     drop=d.drop, categorical=d.categorical)
    if table.rows < c.trainers:
        raise cfg.ConfigError(f"trainers: {c.trainers} trainers need at least as many rows, but {d.source!r} has {table.rows}; lower trainers")
    if d.eval_fraction > 0:
        # Count what the per-row hash holds out (exactly up to a million rows, where an
        # empty or total split is possible at all).
        n = min(table.rows, 1_000_000)
        held = int(tabular.eval_mask(d.seed, 0, n, d.eval_fraction).sum())
        if held == 0 or held == table.rows:
            what = "no rows" if held == 0 else "every row"
            raise cfg.ConfigError(f"data.eval_fraction: {d.eval_fraction:g} holds out {what} of the {table.rows} in {d.source!r}; choose a fraction between, or 0 for no evaluation set")
    params, objective = objective_params(params, labels, table.label)
    evals = tuple(name for name, on in (("train", c.eval_train), ("eval", d.eval_fraction > 0)) if on)
    return Prepared(table, params, evals, probe(params, labels), params["tree_method"] == "hist", objective)


# ---------------------------------------------------------------- the group of trainers


@dataclass
class _Stream:
    """A group boosting in one collective session: its tracker and one generator per shard."""

    tracker: Tracker
    chunks: dict[int, ObjectRefGenerator]


def speed_shards(rows: int, speeds: list[float]) -> list[tuple[int, int]]:
    """Row ranges in proportion to ``speeds`` (largest remainder), in order.

    >>> speed_shards(9, [1.0, 2.0])
    [(0, 3), (3, 9)]
    """
    sizes = split_by_speed(rows, speeds)
    if min(sizes) < 1:
        raise ValueError(f"{rows} rows over speeds {speeds} leave a shard empty ({sizes}); use fewer trainers")
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return list(zip(bounds[:-1], bounds[1:]))


# ---------------------------------------------------------------- the workload


class XGBoostWorkload(BaseWorkload):
    name = "xgboost"

    def __init__(self, config: XGBoostJobConfig, prep: Prepared | None = None):
        """``prep``: what :func:`prepare` settled from the data; peeked here when None (a
        workload built in code, not by :func:`raylane.prepare.build`: its config gets the
        driver settings it derives here too, so its steps and checkpoints follow its rounds)."""
        self.config = config
        if prep is None:
            derive(config)
        self.prep = prep if prep is not None else prepare(config)
        # Budget, before any trainer makes its shard: per trainer, rows / trainers (at speed
        # 1) x (features x 8 bytes: the float32 matrix and xgboost's own built from it; + 16 a
        # row: label, prediction, gradient pair).
        from raylane import budget
        t, keys = self.prep.table, (("data.rows", "data.num_features") if self.prep.table.kind == "synthetic" else ())
        budget.check(self.name, [budget.Estimate(f"its shard: rows ({t.rows:,}) / trainers ({config.trainers}) x ({len(t.features)} features x 8 + 16) bytes",
                                                 t.rows / config.trainers * (len(t.features) * 8 + 16), keys, ("trainers",))], where="trainer")
        first = self.prep.metrics[0]
        self.main_metric = f"{self.prep.evals[-1]}-{first}" if self.prep.evals else "round"
        self.guarded_metrics = tuple(f"{s}-{first}" for s in self.prep.evals[:1])
        self.metrics = ("round", *(f"{s}-{m}" for s in self.prep.evals for m in self.prep.metrics), "trainers", "chunk_s", "boost_s", "build_s")
        self.progress_metrics = ("round",) + tuple(f"{self.prep.evals[-1]}-{m}" for m in self.prep.metrics if self.prep.evals)
        self.gang: Gang | None = None  # rank i holds shard i
        self.ctx: Context | None = None
        self.shards: list[Shard] = []
        self._joined: dict[int, dict[str, Any]] = {}  # shard index -> what its trainer reported on loading it (node, pid, rows)
        self.group = 0  # bumped whenever the group changes: every trainer then rebuilds its matrices
        self.stream: _Stream | None = None
        self.model: bytes | None = None
        self.round = 0
        self.history: dict[str, list[float]] = {}

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [RoleSpec(ROLE, {"CPU": float(c.threads)}, count=c.trainers, stateful=not c.prefer_spot)]

    def setup(self, ctx: Context) -> None:
        c, d = self.config, self.config.data
        self.ctx = ctx
        # The objective may have been chosen from the labels: say which, and why, first.
        ctx.log.event("xgboost_objective", **self.prep.objective.event(self.prep.metrics))
        print(self.prep.objective.line(self.prep.metrics), flush=True)
        if self.prep.table.categories:
            counts = {col: len(values) for col, values in self.prep.table.categories}
            ctx.log.event("xgboost_categorical", columns=counts)
            print("categorical features: " + ", ".join(f"{col} ({n} categories)" for col, n in counts.items())
                  + "; a value not seen while reading the source counts as missing", flush=True)
        trainer = XGBoostTrainerConfig(self.prep.table, d.eval_fraction, d.seed, c.threads, self.prep.quantile, int(self.prep.params.get("max_bin", 256)))
        self.gang = ctx.gang(ROLE, XGBoostTrainer, actor_args=lambda key: ((trainer,), {}), start_timeout_s=c.load_timeout_s,
                         on_join=self._join, broken=lambda exc: is_collective_error(str(exc)), brief=lambda exc: first_line(str(exc)), rank_order=lambda node: -self._speed(node), rank_name="shard", actor_word="trainer")
        self._ensure_group()

    def _ensure_group(self) -> None:
        """Every shard on a live trainer: dead trainers are replaced, the replacements take
        the lost ranks and load their shards, survivors keep theirs."""
        assert self.gang is not None and self.ctx is not None
        t0 = time.monotonic()
        infos = self.gang.form(timeout_s=self.config.load_timeout_s)
        if not infos:
            return
        kept = [i for i in range(len(self.shards)) if i not in infos]
        self._joined = {**{i: self._joined[i] for i in kept}, **infos}
        self.group += 1
        event = {"group": self.group, "loaded": sorted(infos), "kept": kept, "nodes": {str(i): infos[i]["node"] for i in sorted(infos)},
                 "pids": {str(i): infos[i]["pid"] for i in sorted(infos)}, "seconds": round(time.monotonic() - t0, 3)}
        self.ctx.log.event("xgboost_group", **event)

    def _join(self, rank: int, trainer: Any) -> Any:
        """The gang's ``on_join``: the trainer of ``rank`` loads shard ``rank``."""
        if not self.shards:
            self._plan_shards()
        return trainer.load.remote(self.shards[rank])

    def _speed(self, node_id: str) -> float:
        assert self.ctx is not None
        return next((n.speed for n in self.ctx.cluster.nodes if n.node_id == node_id), 1.0)

    def _plan_shards(self) -> None:
        """Shard sizes follow the speed of each rank's node (the gang gives rank 0 to the
        fastest node on its first formation)."""
        assert self.gang is not None and self.ctx is not None
        speeds = [self._speed(node) for _, node in sorted(self.gang.nodes().items())]
        ranges = speed_shards(self.prep.table.rows, speeds)
        self.shards = [Shard(i, a, b) for i, (a, b) in enumerate(ranges)]
        self.ctx.log.event("xgboost_shards", shards=[[s.start, s.stop] for s in self.shards], speeds=speeds)

    def step(self, step: int) -> dict[str, Any]:
        c = self.config
        if self.stream is None:
            self._ensure_group()
            self.stream = self._start_stream()
        expected = min(self.round + c.checkpoint_every, c.num_boost_round)
        t0 = time.monotonic()
        try:
            items = self.gang.gather(self.stream.chunks, what="train", timeout_s=c.chunk_timeout_s, grace_s=c.collective_timeout_s + 5)
            rounds = {item["round"] for item in items.values()}
            if rounds != {expected}:
                raise RuntimeError(f"trainers reached rounds {sorted(rounds)}, expected {expected}")
            if len({item["model_sha256"] for item in items.values()}) != 1:
                raise RuntimeError(f"the trainers' models differ after round {expected}: the collective did not keep them in step")
        except BaseException:
            self._end_stream("failed")
            raise
        lead = next(item for item in items.values() if "model" in item)
        self.model = lead["model"]
        self.round = expected
        per_round = {f"{s}-{m}": [float(v) for v in values] for s, by_metric in lead["history"].items() for m, values in by_metric.items()}
        for key, values in per_round.items():
            self.history.setdefault(key, []).extend(values)
        self._log_rounds(per_round)
        if self.round >= c.num_boost_round:
            self._end_stream("finished")
        metrics: dict[str, Any] = {"round": self.round, **{k: v[-1] for k, v in per_round.items()}}
        # chunk_s: what the driver waited; boost_s: what the slowest trainer computed (the group
        # works on while the driver checkpoints, so chunk_s can be the smaller).
        metrics.update(trainers=len(items), chunk_s=round(time.monotonic() - t0, 3), boost_s=round(max(i["seconds"] for i in items.values()), 3), build_s=round(max(i["build_s"] for i in items.values()), 3))
        return metrics

    def _start_stream(self) -> _Stream:
        c = self.config
        # Loopback when the whole group is on this node: nothing of it then listens beyond it.
        host = tracker_host([m["node"] for m in self._joined.values()], ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        tracker = Tracker(len(self.shards), c.collective_timeout_s, host)
        args = tracker.worker_args()
        model_ref = None if self.model is None else ray.put(self.model)
        rounds = c.num_boost_round - self.round
        chunks = {i: h.train.remote(args, self.group, model_ref, self.round, rounds, c.checkpoint_every, self.prep.params, self.prep.evals) for i, h in self.gang.handles().items()}
        return _Stream(tracker, chunks)

    def _end_stream(self, outcome: str) -> None:
        """Close the running stream: ``finished`` (all rounds done) or ``failed`` (the group
        broke: wait for every trainer to leave the collective, kill those that do not, and
        make all rebuild their matrices in the next group)."""
        if self.stream is None:
            return
        stream, self.stream = self.stream, None
        if outcome == "failed":
            self.group += 1
            self.gang.drain(stream.chunks, grace_s=self.config.collective_timeout_s + 5)
        stream.tracker.close(finished=outcome == "finished")

    def _log_rounds(self, per_round: dict[str, list[float]]) -> None:
        """One line per round in ``rounds.jsonl`` (metrics.jsonl has one per chunk)."""
        assert self.ctx is not None
        first = self.round - len(next(iter(per_round.values()), []))
        with open(Path(self.ctx.run_dir) / "rounds.jsonl", "a") as f:
            for k in range(self.round - first):
                f.write(json.dumps({"round": first + k + 1, **{key: values[k] for key, values in per_round.items()}}) + "\n")

    def finish(self, ctx: Context) -> None:
        """At the end of the run: model.ubj (loadable by plain xgboost.Booster) and
        history.json (every metric, every round) in the run folder."""
        if self.model is None:
            return
        for name, payload in (("model.ubj", self.model), ("history.json", json.dumps(self.history).encode())):
            path = Path(ctx.run_dir) / name
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(payload)
            os.replace(tmp, path)

    def state_dict(self) -> dict:
        return {"model": self.model, "round": self.round, "history": {k: list(v) for k, v in self.history.items()}, "shards": [[s.start, s.stop] for s in self.shards]}

    def load_state_dict(self, state: dict) -> None:
        self.model = state["model"]
        self.round = int(state["round"])
        self.history = {k: [float(x) for x in v] for k, v in state["history"].items()}
        if self.shards and state.get("shards") != [[s.start, s.stop] for s in self.shards]:
            log.warning("xgboost: the checkpoint was trained on shards %s, this run has %s; training continues on the new shards", state.get("shards"), [[s.start, s.stop] for s in self.shards])
        if self.ctx is not None:
            self.ctx.log.event("xgboost_resume", round=self.round)
        self._end_stream("failed")  # a stream continues the model it started from, not this one

    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str]:
        return self.round, self.config.num_boost_round, "rounds"

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return self.round >= self.config.num_boost_round

    def recover(self, ctx: Context, error: BaseException) -> None:
        self.ctx = ctx
        self._end_stream("failed")
        self._ensure_group()

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:  # the driver shut the trainers down first: a tracker with live workers frees slowly
            stream.tracker.close(finished=False)


def export(conf: XGBoostJobConfig | None, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export``: the booster as ``model.ubj`` (xgboost's own format), as trained to the checkpoint's round."""
    if state.get("model") is None:
        raise ValueError("the checkpoint holds no trees yet (round 0); export a later checkpoint")
    (folder / "model.ubj").write_bytes(bytes(state["model"]))
    return {"rounds": int(state["round"]), **({"params": dict(conf.params)} if conf is not None else {})}


def load_model(folder: Path, manifest: dict) -> Any:
    """``JobSpec.load_model``: an ``xgboost.Booster``."""
    import xgboost as xgb

    return xgb.Booster(model_file=str(Path(folder) / "model.ubj"))


JOB = JobSpec("xgboost", "Distributed XGBoost over trainer actors, one data shard each, resuming from the last chunk when a trainer is lost.", XGBoostJobConfig, XGBoostWorkload,
              prepare=prepare, export=export, load_model=load_model)

if __name__ == "__main__":
    job_main(JOB)
