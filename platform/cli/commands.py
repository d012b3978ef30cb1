"""``raylane cluster``, ``raylane jobs`` and ``raylane run``: the commands of a run on this machine or a cluster it joins."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from raylane import config as cfg
from raylane.cli.app import ADDRESS_HELP, app, connect_failed, console, end, fail


@app.command()
def cluster(
    address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the cluster view as JSON."),
    calibrate: bool = typer.Option(True, help="Measure the speed of nodes without a raylane.io/speed label."),
) -> None:
    """Show the cluster view: nodes, markets, speeds, resources."""
    from raylane import session
    from raylane.cluster import ClusterView

    try:
        session.connect(address)
    except session.ConnectError as exc:
        connect_failed(exc)
    view = ClusterView.from_ray(calibrate=calibrate)
    if as_json:
        typer.echo(json.dumps(view.to_json(), indent=2))
        return
    from raylane import tables

    console.print(tables.cluster_view(view, console.width))


@app.command()
def jobs(
    job: Optional[str] = typer.Argument(None, help="Show this job's config keys with their defaults and docs."),
    wide: bool = typer.Option(False, "--wide", help="Show a job's config keys as a table, however narrow the terminal."),
) -> None:
    """List the workloads that can run, or one job's config.

    Below 120 columns each config key is a block (key, type = default, then its docs); from 120 on, or with --wide, a table."""
    from raylane import registry, tables

    if job is None:
        console.print(tables.jobs_table((name, spec.summary) for name, spec in registry.available().items()))
        return
    try:
        spec = registry.get(job)
    except registry.UnknownJobError as exc:
        fail(str(exc))
    title = f"{spec.name}: config keys (--set key=value)"
    console.print(tables.config_keys(title, cfg.describe(spec.config_cls), console.width, wide=wide))


@app.command()
def export(
    run: str = typer.Argument(..., help="The run: its name under --runs-dir, or its folder."),
    best: bool = typer.Option(False, "--best", help="Export the checkpoint driver.keep_best kept, not the newest."),
    out: Optional[str] = typer.Option(None, help="Folder to write (default: RUN/export, or RUN/export-best)."),
    runs_dir: str = typer.Option("runs", help="Folder holding the run folders."),
) -> None:
    """Write a run's trained model in its field's usual form (export.json lists every file and its sha256)."""
    from pathlib import Path

    from raylane.export import ExportError, export_run, read_export

    folder = Path(runs_dir) / run if (Path(runs_dir) / run).is_dir() else Path(run)
    if not folder.is_dir():
        fail(f"no run {run!r}: neither a run folder nor a run under {runs_dir}/ (--runs-dir)")
    try:
        done = export_run(folder, best=best, out=out)
        manifest = read_export(done)
    except ExportError as exc:
        fail(str(exc))
    files = ", ".join(manifest["files"])
    console.print(f"{manifest['job']}: step {manifest['step']}{' (best)' if best else ''} of run {manifest['run']!r} exported to {done}: {files}; "
                  f"load it with raylane.api.load_model({str(done)!r})", soft_wrap=True, highlight=False)


@app.command()
def run(
    job: str = typer.Argument(..., help="The job to run: a registered name (see `raylane jobs`), path/to/file.py:NAME or package.module:NAME."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file with config overrides."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Override a config key: key=value (repeatable)."),
    address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
    run_name: Optional[str] = typer.Option(None, help="Run name; the same name again resumes from its latest checkpoint."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Show the live progress bar (default: the config's driver.progress)."),
    dashboard: bool = typer.Option(False, help="Start the Ray dashboard (bound to 127.0.0.1) with the embedded Ray."),
    new: bool = typer.Option(False, "--new", help="When --run-name already exists, start a fresh run under a free name (NAME-2, ...) instead of resuming it."),
    resume_with_changes: bool = typer.Option(False, "--resume-with-changes", help="Resume --run-name although the config differs from the one it started with; each change is listed."),
) -> None:
    """Run a job: on an embedded local Ray, or on the cluster at --address.

    The same --run-name again resumes that run from its latest checkpoint, if the config is
    the one it started with; a different config is refused with the keys that differ."""
    from raylane import registry, session
    from raylane.driver import DriverError, RunAborted
    from raylane.launch import run_job, summary_line
    from raylane.prepare import job_config

    try:
        spec = registry.get(job)
        conf = job_config(spec, config_file=config, overrides=set_, run_name=run_name, progress=progress)
    except (registry.UnknownJobError, cfg.ConfigError) as exc:
        fail(str(exc))
    try:
        summary = run_job(spec, conf, address=address, dashboard=dashboard, new=new, resume_with_changes=resume_with_changes)
    except cfg.ConfigError as exc:  # the job's input (data, graph, env) refused before Ray starts
        fail(str(exc))
    except session.ConnectError as exc:  # --address: nothing there, or no handshake within the deadline
        connect_failed(exc)
    except RunAborted as exc:
        fail(str(exc), code=130)
    except DriverError as exc:
        fail(str(exc), code=1)
    if summary["state"] == "stopped":
        console.print(summary_line(spec.name, summary), highlight=False, markup=False)
        console.print(f"run folder: {summary['run_dir']}")
        end(130 if "SIGINT" in str(summary.get("stop_reason")) else 0)  # 130: as a shell reports a program ended by Ctrl-C
        return
    console.print(summary_line(spec.name, summary), highlight=False, markup=False)
    console.print(f"run folder: {summary['run_dir']}")
    end(0)
