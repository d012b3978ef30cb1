"""A job's config and inputs as every run prepares them (:mod:`raylane.prepare`): for unit
tests of what is refused before Ray starts. Tests import it by name (tests/ is on sys.path)::

    from prepared import inputs  # tests/prepared.py

    conf, table = inputs("ps_ctr", "data.path=clicks", "data.label=clicked")
"""

from __future__ import annotations

from typing import Any

from raylane import prepare, registry


def inputs(job: str, *overrides: str, data: dict | None = None) -> tuple[Any, Any]:
    """``job``'s config from ``overrides`` (``key=value``) and what its prepare read from it;
    a bad value or input raises ``ConfigError`` naming it."""
    spec = registry.get(job)
    conf = prepare.job_config(spec, data, overrides=overrides)
    return conf, prepare.read_inputs(spec, conf, quiet=True)


def config(job: str, *overrides: str, data: dict | None = None) -> Any:
    """``job``'s config, its inputs checked as a run checks them (see :func:`inputs`)."""
    return inputs(job, *overrides, data=data)[0]
