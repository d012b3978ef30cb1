"""The registry of runnable jobs.

A job module (``raylane.jobs.<name>``) exposes ``JOB = JobSpec(...)``. Jobs are found
through the ``raylane.jobs`` entry-point group, so the platform never imports a job
module by name and other distributions can add jobs of their own.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable


@dataclass(frozen=True)
class JobSpec:
    """A runnable workload: its name, one line on what it does, its config, and a builder."""

    name: str
    summary: str
    config_cls: type
    build: Callable[[Any], Any]  # config -> Workload


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
