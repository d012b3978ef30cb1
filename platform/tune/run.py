"""``raylane tune JOB``: many raylane runs of one job as Ray Tune trials.

Ray Tune is the engine: its searcher samples the space, its schedulers (ASHA, PBT) stop
and exploit trials, its failure handling restarts a trial whose process was lost from the
trial's newest checkpoint. Each trial is a whole raylane run (:mod:`raylane.tune.trial`).

:func:`prepare` checks everything that can be checked before Ray starts: the job, the
fixed values, the search space against the job's config, the metric against what the
job reports, the scheduler's needs, and (for the embedded Ray) that the concurrency fits
this machine. :func:`search` then runs Tune and returns the trials' rows.

Placement: a trial's own process (its raylane driver) takes ``trial_cpus`` CPUs in a
Tune placement group whose bundle refuses spot nodes (a label selector), so losing a spot
node never loses a trial's driver. The trial's actors are not in that group: raylane's
placement puts them by market and speed, as in a single run, and its pools replace those
lost with a spot node. A group's bundle is pinned to the node Ray picked when the group
formed, which is what a spot-aware plan must avoid. The share of each trial is kept by
admission instead: ``concurrency`` trials' minimum roles must fit the cluster.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from raylane import config as cfg
from raylane.best import metric_mode  # noqa: F401 - also raylane.tune.run's
from raylane.errors import short_error
from raylane.tune.space import SearchSpaceError, Spec, check_space, flatten, trial_config, trial_count

SCHEDULERS = ("none", "asha", "pbt")


@dataclass
class Search:
    """One search: the job, what is fixed, what is searched, and how."""

    job: str
    """Registered job name, path/to/file.py:NAME or package.module:NAME."""
    space: dict[str, Spec]
    """Searched keys and their specs."""
    overrides: list[str] = field(default_factory=list)
    """``key=value`` fixed for every trial."""
    config_file: str | None = None
    """YAML of fixed values."""
    metric: str | None = None
    """Metric to optimise; default: the job's main metric."""
    mode: str | None = None
    """``max`` or ``min``; default: from the metric's name (return, accuracy, auc: max; loss, error: min)."""
    trials: int = 4
    """Samples of the space (each grid point is tried this many times)."""
    concurrency: int = 2
    """Trials running at once."""
    scheduler: str = "none"
    """``none``, ``asha`` (early stopping) or ``pbt`` (population-based training)."""
    name: str = "tune"
    """The search's folder under ``runs_dir``."""
    runs_dir: str = "runs"
    """Folder of the search's folder."""
    max_failures: int = 3
    """Restarts of one trial (from its newest checkpoint) before it is an error."""
    trial_cpus: float = 0.5
    """CPUs held by each trial's driver process (its actors are placed by raylane)."""
    grace_steps: int = 2
    """ASHA: steps every trial runs before it may be stopped."""
    perturbation_interval: int = 0
    """PBT: steps between exploits; 0: the job's ``driver.checkpoint_every_steps``."""
    pbt_synch: bool = False
    """PBT: every trial waits at each perturbation step until all have reached it (Tune's
    synchronous PBT), so the worst trials are always judged against the whole population;
    each wait stops the trial's run at a checkpoint and resumes it from there. Without it
    a trial that finishes before the others reach a perturbation step is out of the
    comparison (Tune compares only running trials)."""
    seed: int | None = None
    """Seed of Tune's sampling (and PBT's mutations)."""


@dataclass
class Prepared:
    """A search checked before Ray starts."""

    search: Search
    spec: Any
    base: Any
    metric: str
    mode: str
    n_trials: int
    roles: list
    max_steps: int
    notes: list[str] = field(default_factory=list)


def prepare(search: Search) -> Prepared:
    """Check the search before Ray starts; ``ConfigError`` / ``SearchSpaceError`` name what is wrong."""
    from raylane import prepare as run_prep
    from raylane import registry

    s = search
    if s.scheduler not in SCHEDULERS:
        raise SearchSpaceError(f"--scheduler {s.scheduler!r}: valid: {', '.join(SCHEDULERS)}")
    for name, value, low in (("--trials", s.trials, 1), ("--concurrency", s.concurrency, 1), ("--max-failures", s.max_failures, 0),
                             ("--grace-steps", s.grace_steps, 1), ("--perturbation-interval", s.perturbation_interval, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SearchSpaceError(f"{name}={value!r}: must be a whole number >= {low}")
    if not isinstance(s.pbt_synch, bool):
        raise SearchSpaceError(f"pbt_synch={s.pbt_synch!r}: must be True or False")
    if s.pbt_synch and s.scheduler != "pbt":
        raise SearchSpaceError(f"--pbt-synch is a PBT setting; --scheduler is {s.scheduler!r}: add --scheduler pbt or drop --pbt-synch")
    if not (isinstance(s.trial_cpus, (int, float)) and 0 < s.trial_cpus <= 64):
        raise SearchSpaceError(f"--trial-cpus={s.trial_cpus!r}: must be a number in (0, 64]")
    spec = registry.get(s.job)
    base = run_prep.job_config(spec, config_file=s.config_file, overrides=s.overrides)
    fixed = {cfg.parse_override(o)[0] for o in s.overrides}
    check_space(spec.config_cls, s.space, base=fixed)
    if not hasattr(base, "driver"):
        raise SearchSpaceError(f"job {spec.name!r}: its config has no driver section; raylane tune runs jobs whose config has driver: DriverConfig")
    filed = flatten(cfg.read_mapping(s.config_file))
    notes = [f"{key}: searched; the value {filed[key]!r} in {s.config_file} is not used" for key in s.space if key in filed]
    # The job's own checks (its input, a free-form mapping's names such as xgboost's params)
    # run once, on a trial's config with every searched key at its first value.
    probe = trial_config(spec, {k: v.values[0] for k, v in s.space.items()}, s.config_file, s.overrides)
    workload = run_prep.build(spec, probe)  # reads the job's input: a bad dataset or env fails here, once
    try:
        metric = s.metric or workload.main_metric
        declared = tuple(getattr(workload, "metrics", ()) or ())
        if declared and metric not in declared:
            raise SearchSpaceError(f"--metric {metric!r}: job {spec.name!r} does not report it; it reports {', '.join(declared)}")
        mode = s.mode or metric_mode(metric)
        if mode not in ("max", "min"):
            raise SearchSpaceError(f"--mode {s.mode!r}: give max or min" if s.mode else
                                   f"--metric {metric!r}: its name does not say whether higher is better; give --mode max or --mode min")
        roles = list(workload.roles())
    finally:
        workload.close()
    if s.scheduler == "pbt":
        if grid := [k for k, v in s.space.items() if v.kind == "grid"]:
            raise SearchSpaceError(f"--scheduler pbt mutates values, and grid() has none to mutate to ({', '.join(grid)}); use choice([...])")
        interval = s.perturbation_interval or base.driver.checkpoint_every_steps
        if interval < 1:
            raise SearchSpaceError("--scheduler pbt needs checkpoints: set --perturbation-interval or driver.checkpoint_every_steps >= 1")
        if base.driver.checkpoint_every_steps != interval:
            notes.append(f"pbt: trials checkpoint every {interval} steps (driver.checkpoint_every_steps was {base.driver.checkpoint_every_steps}), "
                         "so each exploit copies the donor's state of that step")
            base.driver.checkpoint_every_steps = interval
            s.overrides = [o for o in s.overrides if not o.startswith("driver.checkpoint_every_steps=")] + [f"driver.checkpoint_every_steps={interval}"]
        if not s.perturbation_interval:
            notes.append(f"pbt: perturbation interval {interval} steps (driver.checkpoint_every_steps; --perturbation-interval changes it)")
        s.perturbation_interval = interval
        if s.pbt_synch:
            notes.append(f"pbt: synchronous; every {interval} steps each trial stops at its checkpoint until all have reached "
                         "that step, then the worst quantile copies the best")
    if s.scheduler == "asha":
        grace = min(s.grace_steps, base.driver.max_steps)
        notes.append(f"asha: every trial runs at least {grace} step{'' if grace == 1 else 's'}; the longest run {base.driver.max_steps} (driver.max_steps), "
                     "halving the trials at each rung (reduction factor 2)" + (f"; --grace-steps {s.grace_steps} was above driver.max_steps" if grace != s.grace_steps else ""))
    if s.metric is None:
        notes.append(f"metric: {metric} ({mode}), the job's main metric")
    elif s.mode is None:
        notes.append(f"mode: {mode} (from the metric's name {metric!r}; --mode changes it)")
    n = trial_count(s.space, s.trials)
    return Prepared(s, spec, base, metric, mode, n, roles, base.driver.max_steps, notes)


def trial_demand(prep: Prepared) -> dict[str, float]:
    """What one trial needs at least: its driver and each role's minimum count."""
    need = {"CPU": float(prep.search.trial_cpus)}
    for role in prep.roles:
        for res, amount in role.resources.items():
            need[res] = need.get(res, 0.0) + float(amount) * role.lo
    return need


def check_concurrency(prep: Prepared, totals: Mapping[str, float], where: str) -> None:
    """Refuse a concurrency the cluster could never hold, naming the missing resources."""
    per = trial_demand(prep)
    k = min(prep.search.concurrency, prep.n_trials)
    missing = {r: k * a - float(totals.get(r, 0.0)) for r, a in per.items() if k * a > float(totals.get(r, 0.0)) + 1e-9}
    if missing:
        fits = min((math.floor((float(totals.get(r, 0.0)) + 1e-9) / a) for r, a in per.items() if a > 0), default=0)
        raise SearchSpaceError(
            f"--concurrency {prep.search.concurrency}: {k} trials of {prep.spec.name} need "
            + ", ".join(f"{r} {k * a:g}" for r, a in per.items())
            + f" (each: its driver's {prep.search.trial_cpus:g} CPU and its roles' minimum), but {where} has "
            + ", ".join(f"{r} {float(totals.get(r, 0.0)):g}" for r in per)
            + "; missing " + ", ".join(f"{r} {m:g}" for r, m in missing.items())
            + f". At most {max(fits, 0)} fit: lower --concurrency, --trial-cpus or the job's worker counts")


def local_totals() -> dict[str, float]:
    """What an embedded Ray of this machine will have: its CPUs (Ray counts them the same way), no GPU unless torch sees one."""
    totals = {"CPU": float(os.cpu_count() or 1)}
    try:
        import torch

        if torch.cuda.is_available():
            totals["GPU"] = float(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - without torch there is no GPU for raylane
        pass
    return totals


def _event(folder: Path, kind: str, **data: Any) -> None:
    """One line of the search's own ``events.jsonl`` (each trial's run folder has its own)."""
    import json
    import time

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"time": time.time(), "event": kind, **data}, default=str) + "\n")


def search_folder(search: Search) -> Path:
    return Path(search.runs_dir).resolve() / search.name


def run_search(prep: Prepared, *, address: str | None = None, say: Any = print) -> Any:
    """Run the search on the Ray this process is connected to, else on ``address`` (None: an
    embedded Ray of this machine). Returns Tune's ``ResultGrid``; the trials' rows are
    :func:`raylane.tune.results.rows` of it."""
    import ray
    from ray import tune
    from ray.tune import schedulers
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from raylane import registry, session
    from raylane.cluster import MARKET_LABEL
    from raylane.tune.trial import RaylaneTrial, TrialPlan

    s = prep.search
    folder = search_folder(s)
    if folder.exists() and any(folder.iterdir()):
        raise SearchSpaceError(f"search folder {folder} already exists; choose another --name (or delete it)")
    if not ray.is_initialized():
        if address in (None, "", "local"):
            check_concurrency(prep, local_totals(), "this machine")
        session.connect(address)
    check_concurrency(prep, ray.cluster_resources(), "the cluster")
    for note in prep.notes:
        say(note)
    _event(folder, "tune_search", job=prep.spec.name, space={k: v.text for k, v in s.space.items()}, fixed=list(s.overrides),
           config_file=s.config_file, metric=prep.metric, mode=prep.mode, trials=prep.n_trials, concurrency=s.concurrency,
           scheduler=s.scheduler, grace_steps=s.grace_steps, perturbation_interval=s.perturbation_interval, pbt_synch=s.pbt_synch,
           max_failures=s.max_failures, trial_cpus=s.trial_cpus, seed=s.seed, decided=list(prep.notes))
    # Trials run in Tune's own working folders: a job file named relative to this one is made absolute.
    plan = TrialPlan(job=registry.portable_target(s.job), overrides=tuple(s.overrides), config_file=None if s.config_file is None else str(Path(s.config_file).resolve()),
                     runs_root=str(folder / "trials"), metric=prep.metric)
    # the trial's own process never on spot: a label selector on its one bundle ("!spot" also takes unlabelled nodes)
    resources = tune.PlacementGroupFactory([{"CPU": s.trial_cpus}], bundle_label_selector=[{MARKET_LABEL: "!spot"}])
    trainable = tune.with_resources(tune.with_parameters(RaylaneTrial, plan=plan), resources)
    space = {k: v.to_tune() for k, v in s.space.items()}
    scheduler: Any = None
    if s.scheduler == "asha":
        scheduler = schedulers.ASHAScheduler(time_attr="step", max_t=prep.max_steps, grace_period=min(s.grace_steps, prep.max_steps),
                                                  reduction_factor=2)
    elif s.scheduler == "pbt":
        scheduler = schedulers.PopulationBasedTraining(time_attr="step", perturbation_interval=s.perturbation_interval,
                                                            hyperparam_mutations=dict(space), synch=s.pbt_synch)
    tracker = _Tracker(prep.metric)
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric=prep.metric, mode=prep.mode, num_samples=s.trials, scheduler=scheduler, reuse_actors=False,
                                    search_alg=BasicVariantGenerator(max_concurrent=s.concurrency, random_state=s.seed)),
        run_config=tune.RunConfig(name=s.name, storage_path=str(folder.parent), verbose=0, callbacks=[tracker],
                                  failure_config=tune.FailureConfig(max_failures=s.max_failures),
                                  # PBT copies donors' checkpoints of its own choosing: all are kept there
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=None if s.scheduler == "pbt" else 5)),
    )
    say(f"tune {prep.spec.name}: {prep.n_trials} trials, {s.concurrency} at a time, scheduler {s.scheduler}, {prep.metric} ({prep.mode}); folder {folder}")
    # Ray Tune's default output prints its own "Configuration for experiment" box at every
    # verbosity; its legacy reporter at verbose=0 prints nothing (raylane says what it runs).
    # A RAY_AIR_NEW_OUTPUT the user set is left as it is.
    chosen = "RAY_AIR_NEW_OUTPUT" in os.environ
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    try:
        grid = tuner.fit()
    finally:
        if not chosen:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
    grid.raylane_recoveries = dict(tracker.recovered)  # type: ignore[attr-defined]
    return grid


class _Tracker:
    """A Tune callback that says each trial's end and counts the restarts of each trial."""

    def __new__(cls, metric: str) -> Any:
        from ray import tune

        from raylane.runlog import say  # a module function: Tune pickles its callbacks

        class Tracker(tune.Callback):
            def __init__(self) -> None:
                self.recovered: dict[str, int] = {}

            def on_trial_recover(self, iteration, trials, trial, **info):  # noqa: ANN001 - Tune's signature
                self.recovered[trial.trial_id] = self.recovered.get(trial.trial_id, 0) + 1
                say(f"trial {trial.trial_id}: its process was lost; Tune restarts it from its newest raylane checkpoint")

            def on_trial_complete(self, iteration, trials, trial, **info):  # noqa: ANN001
                last = trial.last_result or {}
                say(f"trial {trial.trial_id}: ended after {last.get('step', '?')} steps; {metric}={last.get(metric, '?')}")

            def on_trial_error(self, iteration, trials, trial, **info):  # noqa: ANN001
                say(f"trial {trial.trial_id}: failed after {trial.num_failures} restarts (see its folder)")

        return Tracker()


def tune(search: Search, *, address: str | None = None, say: Any = print) -> tuple[Prepared, list[dict], dict[str, Path]]:
    """Check, run and tabulate a search: (the checked search, its rows best first, the files
    written: ``trials.csv``, ``trials.json``, the plot). Each row is
    :func:`raylane.tune.results.trial_row`; its ``state`` is ``error`` for a trial Tune gave up on."""
    from raylane.tune import results as tune_results

    prep = prepare(search)
    grid = run_search(prep, address=address, say=say)
    errors = {_trial_id(r): short_error(r.error) for r in grid if r.error is not None}
    folder = search_folder(prep.search)
    table = tune_results.rows(folder / "trials", prep.metric, prep.mode, {t: "error" for t in errors})
    for row in table:
        row["error"] = errors.get(row["trial"])
    seen = {row["trial"] for row in table}
    # A trial that failed before its run folder was made still has a row: its error.
    table += [tune_results.failed_row(t, why, prep.metric) for t, why in sorted(errors.items()) if t not in seen]
    files = tune_results.write(folder, table, prep.metric)
    counts: dict[str, int] = {}
    for row in table:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    best = tune_results.best(table, prep.metric)
    _event(folder, "tune_end", states=counts, best=None if best is None else best["trial"], files={k: str(v) for k, v in files.items()})
    return prep, table, files


def _trial_id(result: Any) -> str:
    """A Tune result's trial id (from its metrics, else its folder's name, which ends with it)."""
    if result.metrics and result.metrics.get("trial_id"):
        return str(result.metrics["trial_id"])
    name = Path(str(result.path)).name  # e.g. RaylaneTrial_3f2a1_00001_1_lr=0.1_2026-...: Tune's trial id is its 2nd and 3rd parts
    parts = name.split("_")
    return "_".join(parts[1:3]) if len(parts) > 2 else name
