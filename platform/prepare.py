"""One way to prepare a run, for ``raylane run``, ``python -m raylane.jobs.X``,
:mod:`raylane.api`, tune trials and benchmarks alike:

1. :func:`job_config`: the job's defaults <- a mapping <- a YAML file <- ``--set``
   overrides, each value checked (``validate`` hooks check values only: no I/O, no writes
   to other sections);
2. :func:`derive`: the settings a job derives from its own keys, declared by its config's
   ``derived()`` (xgboost's steps from its rounds), applied and said;
3. :func:`read_inputs` and :func:`build`: the job's inputs read once (``JobSpec.prepare``)
   and its workload built, a bad input a :class:`~raylane.config.ConfigError` before Ray starts;
4. :func:`begin`: what a run does before its driver starts (its record, its first events).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from raylane import config as cfg
from raylane import runrecord
from raylane.best import rule_for
from raylane.registry import JobSpec
from raylane.runlog import RunLog, say
from raylane.runpaths import RunPathError, check_run_name


def job_config(spec: JobSpec, data: Mapping[str, Any] | None = None, *, config_file: str | None = None, overrides: Sequence[str] = (),
               run_name: str | None = None, progress: bool | None = None, run_name_key: str = "--run-name") -> Any:
    """The job's checked config: defaults <- ``data`` <- the YAML ``config_file`` <-
    ``overrides`` (``key=value``), then ``run_name`` and ``progress`` where given, then the
    settings the job derives. A bad value raises ``ConfigError`` naming the key (``run_name``
    as ``run_name_key``) and what is valid."""
    conf = cfg.load_config(spec.config_cls, data=data, yaml_path=config_file, overrides=list(overrides))
    # Set directly, not as an override: a run name like 2024-05-01 or 123 is a name, not YAML.
    if run_name is not None:
        try:
            conf.driver.run_name = check_run_name(run_name, run_name_key)
        except RunPathError as exc:
            raise cfg.ConfigError(str(exc)) from None
    if progress is not None:
        conf.driver.progress = progress
    derive(conf)
    return conf


def derive(conf: Any) -> list[str]:
    """Apply what ``conf.derived()`` declares ({dotted key: (value, why)}; a config without
    it derives nothing) and return a line for each, as the run says them."""
    hook = getattr(conf, "derived", None)
    lines = []
    for key, (value, why) in (hook() if callable(hook) else {}).items():
        *parents, leaf = key.split(".")
        node = conf
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
        lines.append(f"{key} = {value!r} ({why})")
    return lines


def read_inputs(spec: JobSpec, conf: Any, *, quiet: bool = False) -> Any:
    """``conf``'s values checked, its derived settings applied (and said unless ``quiet``),
    and the job's inputs read once (``JobSpec.prepare``; None for a job without). A bad value
    or input is a ``ConfigError`` naming it, before Ray or any actor starts."""
    try:
        cfg.validate(conf)
        for line in derive(conf):
            if not quiet:
                say(f"{spec.name}: {line}")
        return None if spec.prepare is None else spec.prepare(conf)
    except cfg.ConfigError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        raise cfg.ConfigError(f"{spec.name}: {exc}") from exc


def build(spec: JobSpec, conf: Any, *, quiet: bool = False) -> Any:
    """The job's workload for ``conf``, its inputs read once (:func:`read_inputs`)."""
    inputs = read_inputs(spec, conf, quiet=quiet)
    try:
        workload = spec.build(conf) if spec.prepare is None else spec.build(conf, inputs)
    except cfg.ConfigError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        raise cfg.ConfigError(f"{spec.name}: {exc}") from exc
    if (driver := getattr(conf, "driver", None)) is not None:
        try:  # the metric keep_best and early_stop compare is one the job reports (known once it is built)
            rule_for(driver, workload)
        except ValueError as exc:
            workload.close()
            raise cfg.ConfigError(f"{spec.name}: {exc}") from None
    return workload


def begin(spec: JobSpec, conf: Any, run_dir: Path, changes: list, events: Sequence[dict] = (), *, quiet: bool = False) -> Any:
    """What a run does before its driver starts, once :func:`raylane.runrecord.check_resume`
    has judged ``conf`` against the run's own (``changes``: the keys accepted as changed):
    the workload built (:func:`build`), the run's record written, and ``events`` (each a
    dict with its ``kind``), the derived settings and the changes logged to its
    ``events.jsonl``. Returns the workload."""
    workload = build(spec, conf, quiet=quiet)
    runrecord.write_record(spec.name, conf, run_dir)
    derived = derive(conf)  # applied already: the lines the run said, for its events too
    if events or changes or derived:
        log = RunLog(run_dir, tensorboard=False)
        for e in events:
            log.event(**e)
        if derived:
            log.event("derived_settings", settings=derived)
        if changes:
            log.event("config_changed", changes=[{"key": k, "run": a, "now": b} for k, a, b in changes])
        log.close()
    return workload
