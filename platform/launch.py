"""Running a job: its config prepared (:mod:`raylane.prepare`), Ray joined, the run driven, where it went reported.

Shared by ``raylane run`` and ``python -m raylane.jobs.<name>`` (which is what
``raylane submit`` and ``ray job submit`` execute on a cluster), so both take the
same flags and refuse a bad config before Ray starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from pathlib import Path

from raylane import config as cfg
from raylane import prepare, runrecord
from raylane.join import ConnectError
from raylane.registry import JobSpec
from raylane.runlock import RunBusy, RunLock
from raylane.runpaths import RunPathError


def run_job(spec: JobSpec, conf: Any, *, address: str | None = None, dashboard: bool = False, new: bool = False, resume_with_changes: bool = False) -> dict:
    """Drive one run of ``spec`` with ``conf`` on the given (or an embedded) Ray; returns its summary.

    A run name that already has a run folder resumes that run, if ``conf`` is the config
    it started with; otherwise this refuses (naming the keys) unless ``new`` (a fresh run
    under a free name) or ``resume_with_changes`` (continue with the new values, listed)."""
    from raylane.driver import default_run_name
    from raylane.runlog import say as _say

    try:
        conf.driver.check_paths()
    except RunPathError as exc:
        raise cfg.ConfigError(str(exc)) from None
    runs = Path(conf.driver.runs_dir)
    name = conf.driver.run_name = conf.driver.run_name or default_run_name(spec.name)
    if new and (runs / name).exists():
        conf.driver.run_name = runrecord.next_free_name(runs, name)
        _say(f"run {name!r} exists; --new starts a fresh run named {conf.driver.run_name!r}")
    run_dir = runs / conf.driver.run_name
    # Held from before the record is read to the run's end: a second run under this name is
    # refused here, before it writes anything (the driver takes the same lock again).
    try:
        lock = RunLock(run_dir)
        lock.acquire()
    except RunBusy as exc:
        raise cfg.ConfigError(str(exc)) from None
    try:
        return _run_locked(spec, conf, run_dir, name, address=address, dashboard=dashboard, resume_with_changes=resume_with_changes)
    finally:
        lock.release()


def _run_locked(spec: JobSpec, conf: Any, run_dir: Path, name: str, *, address: str | None, dashboard: bool, resume_with_changes: bool) -> dict:
    from raylane import session
    from raylane.driver import Driver
    from raylane.runlog import say as _say

    changes = runrecord.check_resume(spec.name, conf, run_dir, accept_changes=resume_with_changes)
    if not changes and (done := runrecord.finished_summary(run_dir)) is not None:
        _say(f"run {conf.driver.run_name!r} finished at step {done.get('steps')}; its files are left as they are. To train it further, "
             f"run it again with --resume-with-changes and a higher driver.max_steps (now {conf.driver.max_steps}); --new starts a fresh run")
        return done
    renamed = [{"kind": "run_renamed", "asked": name, "used": conf.driver.run_name, "reason": "--new: the asked name is an existing run"}]
    workload = prepare.begin(spec, conf, run_dir, changes, renamed if conf.driver.run_name != name else [])
    for k, a, b in changes:
        _say(f"resuming with a changed {k}: {a!r} -> {b!r}")
    session.connect(address, dashboard=dashboard)
    return Driver(workload, conf.driver).run()


def summary_line(job: str, summary: dict) -> str:
    """The line a run ends with, as ``raylane run`` prints it; a submitted job prints it too, so
    ``raylane submit --follow`` can end with it (:func:`raylane.submission.final_summary` reads it back).

    >>> summary_line("linreg", {"state": "finished", "steps": 5, "wall_time_s": 1.84, "final_metrics": {"loss": 0.010093, "workers": 2}})
    'linreg: finished after 5 steps in 1.8 s; loss=0.01009, workers=2'
    """
    if summary["state"] == "stopped":
        return (f"{job}: stopped at step {summary['steps']} ({summary.get('stop_reason') or 'stop requested'}); "
                f"run again with --run-name {summary['run']} to continue")
    metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary["final_metrics"].items())
    line = f"{job}: {summary['state']} after {summary['steps']} steps in {summary['wall_time_s']:.1f} s; {metrics}"
    if (why := summary.get("end_reason")) and why != "stop condition reached":
        line += f" ({why})"
    if (best := summary.get("best")) and best.get("value") is not None:
        kept = best.get("kept") or {}
        line += f"; best {best['metric']}={kept.get('value', best['value']):.4g} at step {kept.get('step', best['step'])}"
        line += f", kept in {kept['path']}" if kept else ""
    return line


def job_main(spec: JobSpec, argv: Sequence[str] | None = None) -> None:
    """``python -m raylane.jobs.<name> [--config F] [--set k=v ...] [--address A] [--run-name N]``."""
    parser = argparse.ArgumentParser(prog=f"python -m raylane.jobs.{spec.name}", description=spec.summary)
    parser.add_argument("--config", help="YAML file with config overrides")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config key (repeatable)")
    parser.add_argument("--address", default=None, help="Ray address to join; default: the cluster this runs on (auto) when launched as a Ray job, else an embedded local Ray")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--new", action="store_true", help="a fresh run under a free name when --run-name exists")
    parser.add_argument("--resume-with-changes", action="store_true", help="resume --run-name although its config differs (the changes are listed)")
    args = parser.parse_args(argv)
    try:
        conf = prepare.job_config(spec, config_file=args.config, overrides=args.set, run_name=args.run_name, progress=False if args.no_progress else None)
    except cfg.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    address = args.address or ("auto" if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID") else None)
    try:
        summary = run_job(spec, conf, address=address, new=args.new, resume_with_changes=args.resume_with_changes)
    except cfg.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ConnectError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if exc.stuck:  # ray.init still runs in its thread: Ray's exit hooks would wait on it
            sys.stdout.flush()
            os._exit(2)
        raise SystemExit(2) from None
    print(summary_line(spec.name, summary))
    print(f"run folder: {summary['run_dir']}")
