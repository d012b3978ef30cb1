"""The contract between the driver and a workload: the config every run has, the context a
workload builds itself from, the hooks the driver calls (required and optional, with
defaults), and how a failure is judged recoverable. A workload implements
:class:`Workload`; subclassing :class:`BaseWorkload` gives every optional hook its default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.fs as pafs

from raylane import config as cfg
from raylane.checkpoint import CheckpointStore
from raylane.cluster import ClusterView
from raylane.placement import ANY, ON_DEMAND, SPOT, Plan, RoleSpec
from raylane.policies import PoolAutoscale
from raylane.errors import is_recoverable  # noqa: F401 - part of the contract
from raylane.group import Gang, Groups, TaskPool
from raylane.runlog import RunLog
from raylane.runpaths import check_run_name, check_writable_dir


class DriverError(RuntimeError):
    """The run ended FAILED; the message says why and where its last checkpoint is."""


class RayGone(DriverError):
    """The Ray this process started died under the run."""


class RunAborted(DriverError):
    """The user aborted the run (a second Ctrl-C); the run folder says STOPPED."""


class NonFiniteError(DriverError):
    """A guarded metric (a loss) became NaN or infinite."""


# Schemes pyarrow.fs opens by contacting a service (a bucket's region, a namenode): taken on
# their name, so validating a config makes no network call; a wrong bucket fails on first use.
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
_WORKS = "a local folder, file://, s3://, gs:// (or gcs://), hdfs://, abfs:// (as this pyarrow supports them)"


def check_uri_scheme(uri: str, what: str) -> None:
    """Refuse a URI whose scheme ``pyarrow.fs`` cannot open (``nosuchfs://b/x``, ``S3://``)
    before Ray starts, naming ``what``, the scheme and what works; local paths pass.

    >>> check_uri_scheme("s3://bucket/ckpt", "checkpoint_uri")
    """
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme in REMOTE_SCHEMES:
        return
    try:
        pafs.FileSystem.from_uri(uri)  # local schemes only here (file://, local://): no network
    except pa.ArrowInvalid as exc:
        if "Unrecognized filesystem type" in str(exc):
            raise ValueError(f"{what}={uri!r}: pyarrow.fs cannot open the scheme {scheme!r}; use {_WORKS}") from None
        raise ValueError(f"{what}={uri!r}: pyarrow.fs cannot open it ({exc}); use {_WORKS}") from None


@dataclass
class DriverConfig:
    """How a run is driven: its name and folder, stop rules, checkpoints, failures."""

    run_name: str | None = None
    """Run name; its files go to ``<runs_dir>/<run_name>/``. Running the same name again resumes it. Default: ``<job>-<date>-<time>``."""
    runs_dir: str = "runs"
    """Folder holding every run's folder."""
    max_steps: int = cfg.field(100, ge=1)
    """Stop after this many steps (the workload may stop earlier on its own target)."""
    max_wall_s: float = cfg.field(0.0, ge=0)
    """Stop after this many seconds of wall time; 0 means no limit."""
    checkpoint_uri: str | None = None
    """Where checkpoints go: a local folder or any pyarrow URI (``s3://...``); ``<uri>/<run_name>/<step>/``. Default: ``<run folder>/checkpoints``."""
    checkpoint_every_steps: int = cfg.field(10, ge=0)
    """Checkpoint every N steps (0: off). Also at the end and at once on a preemption notice."""
    checkpoint_every_s: float = cfg.field(0.0, ge=0)
    """Checkpoint when this many seconds passed since the last one (0: off)."""
    keep_checkpoints: int = cfg.field(3, ge=1)
    """Keep the newest K checkpoints."""
    keep_best: bool = False
    """Keep the checkpoint of the best evaluation of ``best_metric`` apart from the rotation,
    in ``<checkpoints>/best/`` (an evaluation that improves on the best is checkpointed at
    once, in the background where the job's actors write their own parts); the summary
    names its step, value and folder."""
    best_metric: str = ""
    """The metric ``keep_best`` and ``early_stop_patience`` compare (one the job reports); empty: the job's main metric."""
    best_mode: Literal["auto", "max", "min"] = "auto"
    """Whether a higher (``max``) or lower (``min``) ``best_metric`` is better; ``auto``: from its name (auc, acc, return: max; loss, error: min)."""
    early_stop_patience: int = cfg.field(0, ge=0)
    """End the run (FINISHED, the reason in the summary) after this many evaluations of
    ``best_metric`` in a row without an improvement; 0: never. Steps that do not report the
    metric are not evaluations."""
    early_stop_min_delta: float = cfg.field(0.0, ge=0)
    """An evaluation improves on the best only when it beats it by more than this."""
    replicate_every_steps: int = cfg.field(1, ge=1)
    """Stateful actors that write their own checkpoint parts also hand a snapshot to a keeper
    on another node every N steps; a lost one is restored from that copy in memory (at most
    N steps run again), from the store only when the copy is gone too."""
    hot_spares: int = cfg.field(0, ge=0)
    """Started actors each gang (parameter shards and PS workers, a learner, XGBoost
    trainers, pipeline stages) keeps beside its ranks, holding none: a lost rank is taken
    over by a running spare, so a recovery does not wait seconds for a replacement to
    start. Each spare reserves its role's resources where the cluster has room."""
    max_failures: int = cfg.field(3, ge=0)
    """Failures the run recovers from before it is FAILED."""
    max_recovery_s: float = cfg.field(600.0, ge=0)
    """Seconds one recovery may take (failure to running again) before the run is FAILED; 0: no limit."""
    placement_wait_s: float = cfg.field(30.0, ge=0)
    """When the roles fit the cluster but not what is free right now (the actors of a run
    that just ended release their CPUs asynchronously; another job holds them), wait this
    long for capacity to free before failing to start (said on the terminal and logged)."""
    resume: bool = True
    """Continue from the run's latest checkpoint when the run folder already has one."""
    autoscale: bool = True
    """Grow elastic pools when nodes join and shrink them when nodes leave."""
    progress: bool = True
    """Show a live progress bar."""
    tensorboard: bool = True
    """Write TensorBoard scalars under ``<run folder>/tb``."""
    control: bool = True
    """Serve ``raylane pools`` and ``raylane scale`` for this run."""
    pool_autoscale: list[PoolAutoscale] = field(default_factory=list)
    """Autoscaled pools: a list of {role, min, max, ...}."""
    stateful_market: Literal["on-demand", "spot", "any"] = "on-demand"
    """Where stateful roles (parameter shards, stages, learners, trainers) go first:
    ``on-demand``, ``spot`` (the spot price for the state; a lost actor is restored from the
    checkpoint) or ``any``; each falls back to the other market when it has no room."""
    role_markets: dict[str, Literal["on-demand", "spot", "any"]] = field(default_factory=dict)
    """Per role, overriding ``stateful_market`` and the stateless default (spot): ``{param_shard: spot}``."""

    def validate(self) -> None:
        markets = (ON_DEMAND, SPOT, ANY)
        if self.stateful_market not in markets:
            raise ValueError(f"driver.stateful_market={self.stateful_market!r}: use one of {', '.join(markets)}")
        for role, market in self.role_markets.items():
            if market not in markets:
                raise ValueError(f"driver.role_markets.{role}={market!r}: use one of {', '.join(markets)}")
        if self.run_name is not None:
            check_run_name(self.run_name, "run_name")
        if self.checkpoint_uri is not None:
            check_uri_scheme(self.checkpoint_uri, "checkpoint_uri")

    def with_markets(self, roles: list[RoleSpec]) -> list[RoleSpec]:
        """``roles`` with ``stateful_market`` and ``role_markets`` applied; a role name in
        ``role_markets`` that the job does not have is refused, naming its roles."""
        names = [r.name for r in roles]
        if unknown := sorted(set(self.role_markets) - set(names)):
            raise ValueError(f"driver.role_markets names {unknown}, which this job does not have; its roles: {names}")
        return [replace(r, market=self.role_markets.get(r.name, self.stateful_market if r.stateful else r.market)) for r in roles]

    def store_uri(self, run_dir: Any) -> str:
        """Where this run's checkpoints go (see ``checkpoint_uri``)."""
        uri = self.checkpoint_uri
        if uri is None:
            return str(Path(run_dir) / "checkpoints")
        base, sep, query = uri.partition("?")  # options of the filesystem (s3's endpoint_override, region) stay at the end
        return f"{base.rstrip('/')}/{Path(run_dir).name}{sep}{query}"

    def check_paths(self) -> None:
        """Make and write to the run and checkpoint folders (before Ray starts): a folder
        that cannot be written is a one-line error, not a failure after the actors are up."""
        check_writable_dir(self.runs_dir, "driver.runs_dir")
        if self.checkpoint_uri is not None:
            check_writable_dir(self.checkpoint_uri, "driver.checkpoint_uri")


@dataclass
class Context:
    """What a workload gets to build itself: the cluster, the plan for its roles, a store, the
    run's folder and log, and its groups. A workload asks for its actors here
    (:meth:`task_pool`, :meth:`gang`) and keeps the handles; the driver owns the groups: it
    sizes and starts them from the plan, reports and resizes them, re-forms them on recovery
    and shuts them down at the end."""

    cluster: ClusterView
    plan: Plan
    store: CheckpointStore
    run_dir: Path
    log: RunLog
    groups: Groups

    def task_pool(self, role: str, actor_cls: Any, **options: Any) -> TaskPool:
        """A task pool of interchangeable actors of ``role`` (options: :class:`~raylane.group.TaskPool`'s)."""
        return self.groups.task_pool(role, actor_cls, **options)

    def gang(self, role: str, actor_cls: Any, **options: Any) -> Gang:
        """A gang of ranked actors of ``role`` (options: :class:`~raylane.group.Gang`'s, ``on_join`` among them)."""
        return self.groups.gang(role, actor_cls, **options)


_HOOKS = """
    - ``roles()``, ``setup(ctx)``, ``step(step)``, ``state_dict()``, ``load_state_dict(state)``: required.
    - ``done(step, metrics)`` after every step: True ends the run FINISHED (default: never; the stop rules end it).
    - ``recover(ctx, error)`` after a recoverable failure, before the driver re-forms the groups
      and reloads the last checkpoint: what the workload itself must rebuild (default: nothing).
    - ``on_event(event)`` for each node event: True asks for a checkpoint now (default: False).
    - ``waits()`` between steps: seconds each role's consumer waited for it, for the utilisation autoscaler (default: none).
    - ``progress_of(step, metrics)``: ``(done, total, unit)`` of the workload's own stop rule, for the progress bar (default: none).
    - ``finish(ctx)`` once, after the final checkpoint of a run that FINISHED or STOPPED (default: nothing).
    - ``close()`` always, last, after the driver shut the groups down: free what else it holds (default: nothing).
"""


@runtime_checkable
class Workload(Protocol):
    __doc__ = "What the driver needs from a workload; :class:`BaseWorkload` gives every optional member its default.\n" + _HOOKS

    name: str
    main_metric: str
    guarded_metrics: tuple[str, ...]
    metrics: tuple[str, ...]
    progress_metrics: tuple[str, ...]

    def roles(self) -> list[RoleSpec]: ...
    def setup(self, ctx: Context) -> None: ...
    def step(self, step: int) -> dict[str, Any]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def done(self, step: int, metrics: dict[str, Any]) -> bool: ...
    def recover(self, ctx: Context, error: BaseException) -> None: ...
    def on_event(self, event: Any) -> bool: ...
    def waits(self) -> dict[str, float]: ...
    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str] | None: ...
    def finish(self, ctx: Context) -> None: ...
    def close(self) -> None: ...


def default_run_name(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S')}"


class BaseWorkload:
    __doc__ = "Defaults for every optional member of :class:`Workload` (the same list); a subclass implements the required ones.\n" + _HOOKS

    name: str = "workload"
    main_metric: str = "loss"
    guarded_metrics: tuple[str, ...] = ()
    """Metrics that must stay finite besides ``main_metric`` (always guarded); a NaN or
    infinity stops the run naming the metric."""

    metrics: tuple[str, ...] = ()
    """The numbers the job reports (empty: not declared), some perhaps only at some steps
    (an evaluation at an epoch's end). ``raylane tune --metric`` is checked against them
    before Ray starts, and its trials report to Tune at the steps that carry the metric;
    undeclared, the metric must be in the first step's metrics."""

    progress_metrics: tuple[str, ...] = ()
    """Metrics shown beside the progress bar (empty: the main metric)."""

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return False

    def recover(self, ctx: Context, error: BaseException) -> None:
        return None

    def on_event(self, event: Any) -> bool:
        return False

    def waits(self) -> dict[str, float]:
        return {}

    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str] | None:
        return None

    def finish(self, ctx: Context) -> None:
        return None

    def close(self) -> None:
        return None


def check_workload(workload: Any) -> None:
    """Refuse, naming them, a workload that lacks members of :class:`Workload`."""
    members = [m for m in vars(Workload) if not m.startswith("_")] + list(Workload.__annotations__)
    if missing := sorted(m for m in set(members) if not hasattr(workload, m)):
        raise TypeError(f"workload {type(workload).__name__} lacks {missing}: subclass raylane.api.BaseWorkload, "
                        "which gives every optional member its default")
