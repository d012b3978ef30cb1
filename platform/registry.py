"""The registry of runnable jobs.

A job module (``raylane.jobs.<name>``) exposes ``JOB = JobSpec(...)``. Jobs are found
through the ``raylane.jobs`` entry-point group, so the platform never imports a job
module by name and other distributions can add jobs of their own.
"""

from __future__ import annotations

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
    ``build(config)`` returns a :class:`raylane.workload.Workload`."""

    name: str
    summary: str
    config_cls: type
    build: Callable[[Any], "Workload"]

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
    jobs = available()
    if name in jobs:
        return jobs[name]
    close = difflib.get_close_matches(name, list(jobs), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownJobError(f"unknown job {name!r}.{hint} Jobs: {', '.join(jobs) or 'none installed'} (see `raylane jobs`).")
