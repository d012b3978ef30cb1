"""The contract between the driver and a workload: the config every run has, the context a
workload builds itself from, the hooks the driver calls (required and optional, with
defaults), and how a failure is judged recoverable. A workload implements
:class:`Workload`; subclassing :class:`BaseWorkload` gives every optional hook its default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.fs as pafs

from raylane import config as cfg
from raylane.checkpoint import CheckpointStore
from raylane.cluster import ClusterView
from raylane.placement import Plan, RoleSpec
from raylane.policies import PoolAutoscale
from raylane.errors import is_recoverable  # noqa: F401 - part of the contract
from raylane.group import Membership
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

    def validate(self) -> None:
        if self.run_name is not None:
            check_run_name(self.run_name, "run_name")
        if self.checkpoint_uri is not None:
            check_uri_scheme(self.checkpoint_uri, "checkpoint_uri")

    def store_uri(self, run_dir: Any) -> str:
        """Where this run's checkpoints go (see ``checkpoint_uri``)."""
        uri = self.checkpoint_uri
        return str(Path(run_dir) / "checkpoints") if uri is None else f"{uri.rstrip('/')}/{Path(run_dir).name}"

    def check_paths(self) -> None:
        """Make and write to the run and checkpoint folders (before Ray starts): a folder
        that cannot be written is a one-line error, not a failure after the actors are up."""
        check_writable_dir(self.runs_dir, "driver.runs_dir")
        if self.checkpoint_uri is not None:
            check_writable_dir(self.checkpoint_uri, "driver.checkpoint_uri")


@dataclass
class Context:
    """What a workload gets to build itself: the cluster, the plan for its roles, a store."""

    cluster: ClusterView
    plan: Plan
    store: CheckpointStore
    run_dir: Path
    log: RunLog

    def count(self, role: str) -> int:
        return self.plan.count(role)


@runtime_checkable
class Workload(Protocol):
    """What the driver needs from a workload. See :class:`Driver` for when each is called."""

    name: str
    main_metric: str
    guarded_metrics: tuple[str, ...]

    def roles(self) -> list[RoleSpec]: ...
    def setup(self, ctx: Context) -> None: ...
    def step(self, step: int) -> dict[str, Any]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def done(self, step: int, metrics: dict[str, Any]) -> bool: ...
    def pools(self) -> dict[str, Membership]: ...
    def recover(self, ctx: Context, error: BaseException) -> None: ...
    def close(self) -> None: ...


def default_run_name(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S')}"


class BaseWorkload:
    """Defaults for a workload's optional hooks; a subclass implements the required ones
    (``roles``, ``setup``, ``step``, ``state_dict``, ``load_state_dict``) and overrides
    the others where it has something to say. When the driver calls each:

    - ``done(step, metrics)`` after every step: True ends the run FINISHED (default: never; the stop rules end it).
    - ``pools()`` between steps: the elastic pools the driver may resize and report (default: none).
    - ``recover(ctx, error)`` after a recoverable failure, before the last checkpoint is reloaded (default: nothing to rebuild).
    - ``on_event(event)`` for each node event: True asks for a checkpoint now (default: False).
    - ``waits()`` between steps: seconds each role's consumer waited for it, for the utilisation autoscaler (default: none).
    - ``progress_of(step, metrics)``: ``(done, total, unit)`` of the workload's own stop rule, for the progress bar (default: none).
    - ``finish(ctx)`` once, after the final checkpoint of a run that FINISHED or STOPPED (default: nothing).
    - ``close()`` always, last: free actors and files (default: nothing).
    """

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

    def pools(self) -> dict[str, Membership]:
        return {}

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


def hook(workload: Any, name: str) -> Any:
    """The workload's optional hook ``name``, or :class:`BaseWorkload`'s default for one
    that implements only the required part of :class:`Workload`."""
    own = getattr(workload, name, None)
    return own if own is not None else getattr(BaseWorkload, name).__get__(workload)
