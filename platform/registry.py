"""The registry of runnable jobs.

A job module (``raylane.jobs.<name>``) exposes ``JOB = JobSpec(...)``. Jobs are found
through the ``raylane.jobs`` entry-point group, so the platform never imports a job
module by name and other distributions can add jobs of their own. A user's job that is
not packaged is named by where it is: ``path/to/file.py:NAME`` or ``package.module:NAME``
(:func:`load_spec`); its module is shipped to the actors by value.
"""

from __future__ import annotations

import os

import dataclasses
import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from raylane.workload import Workload


@dataclass(frozen=True)
class JobSpec:
    """A runnable workload: its name, one line on what it does, its config, and a builder.

    ``config_cls`` is a dataclass of the job's own keys plus ``driver: DriverConfig`` (run
    name, stop rules, checkpoints), so every job takes ``--set driver.max_steps=...``;
    ``build(config)`` returns a :class:`raylane.workload.Workload`, or, when the job has a
    ``prepare``, ``build(config, inputs)`` with what ``prepare(config)`` returned.
    :func:`raylane.prepare.build` is the one place both are called."""

    name: str
    summary: str
    config_cls: type
    build: Callable[..., "Workload"]
    prepare: Callable[[Any], Any] | None = None
    """Reads and checks the job's inputs once, before Ray starts (an env made and wrapped, a
    table described, tokens read); a bad input raises ``ValueError`` naming the key. None:
    the job has no inputs to read, or reads them in ``build``."""
    export: Callable[[Any, dict, Any], dict] | None = None
    """``export(config, state, folder)``: write the trained model held by the workload's
    checkpoint ``state`` into ``folder`` in its field's usual form and return what a loader
    needs to rebuild it (JSON); see :mod:`raylane.export`. ``config`` is the run's (None for
    a run driven from Python, which has no record: the state should describe the model
    itself). None: the job has no export."""
    load_model: Callable[[Any, dict], Any] | None = None
    """``load_model(folder, manifest)``: the exported model, ready to predict without Ray."""

    def __post_init__(self) -> None:
        from raylane.workload import DriverConfig

        fields = {f.name: f for f in dataclasses.fields(self.config_cls)} if dataclasses.is_dataclass(self.config_cls) else None
        driver = fields.get("driver") if fields is not None else None
        made = None
        if driver is not None and driver.default_factory is not dataclasses.MISSING:
            made = driver.default_factory()
        elif driver is not None and driver.default is not dataclasses.MISSING:
            made = driver.default
        if not isinstance(made, DriverConfig):
            raise TypeError(f"job {self.name!r}: its config {getattr(self.config_cls, '__name__', self.config_cls)!r} must be a dataclass "
                            "with a field `driver: DriverConfig = field(default_factory=DriverConfig)` (run name, stop rules, "
                            "checkpoints; give the job's own defaults in the factory)")


class UnknownJobError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def available() -> dict[str, JobSpec]:
    """Every registered job, by name."""
    out = {}
    for ep in entry_points(group="raylane.jobs"):
        spec = ep.load()
        out[spec.name] = spec
    return dict(sorted(out.items()))


def get(name: str) -> JobSpec:
    """A job by its registered name, or a user's job spec by ``path/to/file.py:NAME`` or
    ``package.module:NAME`` (see :func:`load_spec`)."""
    if ":" in name:
        return load_spec(name)
    jobs = available()
    if name in jobs:
        return jobs[name]
    close = difflib.get_close_matches(name, list(jobs), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownJobError(f"unknown job {name!r}.{hint} Jobs: {', '.join(jobs) or 'none installed'} (see `raylane jobs`).")


def portable_target(target: str) -> str:
    """``target`` as another process with another working folder finds it: a job file's
    path made absolute (``jobs/my_job.py:JOB`` -> ``/home/me/proj/jobs/my_job.py:JOB``);
    registered names and ``package.module:NAME`` unchanged.

    >>> portable_target("linreg")
    'linreg'
    """
    where, sep, attr = target.rpartition(":")
    if not sep or not where.endswith(".py"):
        return target
    return f"{os.path.abspath(os.path.expanduser(where))}:{attr}"


def load_spec(target: str) -> JobSpec:
    """The :class:`JobSpec` named ``NAME`` in ``path/to/file.py:NAME`` (imported as
    ``python path/to/file.py`` would: its folder first on ``sys.path``) or in
    ``package.module:NAME`` (imported from ``sys.path``, the current folder included).

    The module is registered with Ray's cloudpickle to travel by value, so the actor
    classes and functions it defines reach every worker without being installed there.
    Each failure is an :class:`UnknownJobError` naming what was tried."""
    from raylane.imports import ImportPathError, load_module

    where, _, attr = target.rpartition(":")
    if not where or not attr.isidentifier():
        raise UnknownJobError(f"job {target!r}: give a registered name, path/to/file.py:NAME or package.module:NAME (NAME: the JobSpec's variable)")
    try:
        module = load_module(where, target, "job")
    except ImportPathError as exc:
        raise UnknownJobError(str(exc)) from None
    spec = getattr(module, attr, None)
    if not isinstance(spec, JobSpec):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, JobSpec))
        what = f"{where!r} has no {attr!r}" if spec is None else f"{attr!r} in {where!r} is of type {type(spec).__name__}, not a JobSpec"
        raise UnknownJobError(f"job {target!r}: {what}; its JobSpecs: {', '.join(found) or 'none'} "
                              "(define NAME = JobSpec(name, summary, ConfigClass, WorkloadClass))")
    return spec
