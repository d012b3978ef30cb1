"""raylane's public Python API: what a workload of your own is written against, and one
call that runs any job, yours or a built-in one, and returns its summary.

A workload subclasses :class:`BaseWorkload`: it declares its roles (:class:`RoleSpec`:
resources, count, stateful or not), asks its context for its actor groups in ``setup``
(``ctx.task_pool``: interchangeable actors; ``ctx.gang``: ranked ones; the driver sizes,
places, re-forms and shuts them down), does one
step per ``step`` call, and gives its state as tensors and plain values in ``state_dict``.
The driver does the rest: placement by node speed and market, checkpoints, recovery from
lost actors and nodes, preemption notices, elastic pools. A :class:`JobSpec` names the
workload with its config (a dataclass with a ``driver: DriverConfig`` field), so the
command line runs it too::

    raylane run path/to/my_job.py:JOB --set workers=4

    from raylane.api import run, run_workload
    summary = run("path/to/my_job.py:JOB", overrides=["workers=4"])
    summary = run_workload(MyWorkload(config), config.driver)  # an instance you built

A finished run's model comes out with ``load_model("runs/NAME")`` (ready to predict, no Ray
needed; ``best=True`` for the step ``driver.keep_best`` kept; ``trust_code=True`` for a model
of your own code, which is imported to rebuild it) or ``export_run`` (the files).

``examples/dp_classifier.py`` is a whole workload in under 100 lines. Everything named in
``__all__`` is the stable surface; the rest of the package may change.
"""

from __future__ import annotations

from typing import Any, Sequence

from raylane import config as cfg
from raylane import prepare
from raylane.checkpoint import CheckpointStore
from raylane.checkpoint_parts import CHECKPOINT_GROUP, CHECKPOINT_GROUPS, CheckpointParts, Part, snapshot
from raylane.export import ExportError, export_run, load_model
from raylane.errors import LOST, CallTimeoutError, GroupLost, PoolError, WorkError, is_recoverable
from raylane.group import Gang, Membership, TaskPool
from raylane.placement import RoleSpec
from raylane.registry import JobSpec, UnknownJobError
from raylane.driver import Driver, State, Stepped
from raylane.workload import BaseWorkload, Context, DriverConfig, DriverError, Workload

__all__ = [
    "CHECKPOINT_GROUP", "CHECKPOINT_GROUPS", "LOST", "BaseWorkload", "CallTimeoutError", "CheckpointParts", "CheckpointStore", "Context", "Driver", "DriverConfig", "DriverError", "ExportError", "Gang", "Part",
    "GroupLost", "JobSpec", "Membership", "PoolError", "RoleSpec", "State", "Stepped", "TaskPool", "UnknownJobError", "WorkError",
    "Workload", "export_run", "is_recoverable", "job", "job_config", "load_model", "run", "run_config", "run_workload", "snapshot", "workload",
]


def job(name: str | JobSpec) -> JobSpec:
    """A job: a :class:`JobSpec` as given, a registered name (``"ppo"``), or a spec of
    your own by ``"path/to/file.py:NAME"`` or ``"package.module:NAME"``."""
    from raylane import registry

    return name if isinstance(name, JobSpec) else registry.get(name)


def job_config(spec: str | JobSpec, config: Any = None, *, overrides: Sequence[str] = (), config_file: str | None = None) -> Any:
    """The job's checked config: its defaults <- ``config`` (an instance of the job's
    config class, or a dict of its keys) <- the YAML ``config_file`` <- ``overrides``
    (``"key=value"`` as ``--set`` takes them). A bad value raises ``ConfigError`` naming
    the key and what is valid."""
    data = cfg.to_dict(config) if _dataclass_instance(config) else dict(config or {})
    return prepare.job_config(job(spec), data, config_file=config_file, overrides=overrides)


def workload(spec: str | JobSpec, config: Any) -> Workload:
    """The job's workload for ``config`` (from :func:`job_config`), its inputs read once;
    run it with :func:`run_workload` or step it with :class:`Driver`."""
    return prepare.build(job(spec), config)


def run(spec: str | JobSpec, config: Any = None, *, overrides: Sequence[str] = (), config_file: str | None = None,
        address: str | None = None, run_name: str | None = None, progress: bool | None = None, new: bool = False,
        resume_with_changes: bool = False) -> dict[str, Any]:
    """Run a job to its end; returns the run's summary (state, steps, final metrics, run folder).

    ``spec`` and ``config``/``config_file``/``overrides`` as for :func:`job` and
    :func:`job_config`. ``address``: None runs on the Ray this process is already
    connected to, else on an embedded Ray of this machine that listens on 127.0.0.1 only;
    ``"auto"`` or ``"host:port"`` joins a cluster (with a deadline). A ``run_name`` that
    already has a run folder resumes it when the config is the one it started with;
    ``new`` starts a fresh run under a free name instead, ``resume_with_changes``
    continues with the changed keys (they are listed). A run that ends FAILED raises
    :class:`DriverError`; a stopped one returns with ``state == "stopped"``."""
    from raylane.launch import run_job

    s = job(spec)
    return run_job(s, run_config(s, config, overrides=overrides, config_file=config_file, run_name=run_name, progress=progress),
                   address=address, new=new, resume_with_changes=resume_with_changes)


def run_workload(workload: Workload, config: DriverConfig, *, address: str | None = None) -> dict[str, Any]:
    """Run a workload instance to its end and return its summary: :class:`Driver` with the
    watchers a user's run has (stop signals, progress bar, plot). Connects to Ray first when
    this process is not connected yet (``address`` as for :func:`run`). To step a run
    yourself (a notebook, a search), use ``Driver(workload, config)``: ``start()``,
    ``step()`` until its state is not RUNNING, ``finish()``."""
    import ray

    if address is not None or not ray.is_initialized():
        from raylane import session

        session.connect(address)
    return Driver(workload, config).run()


def run_config(spec: str | JobSpec, config: Any = None, *, overrides: Sequence[str] = (), config_file: str | None = None,
               run_name: str | None = None, progress: bool | None = None) -> Any:
    """The config :func:`run` runs with: :func:`job_config`, then ``run_name`` and ``progress``
    where given (None keeps what the config says)."""
    data = cfg.to_dict(config) if _dataclass_instance(config) else dict(config or {})
    return prepare.job_config(job(spec), data, config_file=config_file, overrides=overrides, run_name=run_name, progress=progress,
                              run_name_key="run_name")


def _dataclass_instance(value: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(value) and not isinstance(value, type)
