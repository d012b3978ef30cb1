"""The ``raylane`` command line (typer)."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from raylane import config as cfg

app = typer.Typer(
    name="raylane",
    help="Distributed training on heterogeneous, preemptible Ray clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

ADDRESS_HELP = ("Ray address to join (e.g. auto, or host:6379), given up after RAYLANE_CONNECT_TIMEOUT seconds (30). "
                "Default: an embedded local Ray, on 127.0.0.1 only.")


def _fail(message: str, code: int = 2) -> None:
    # escaped: a message may quote text with brackets (pip extras such as gymnasium[box2d]);
    # soft-wrapped: the terminal folds it, so a command in it stays one line to copy
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def _connect_failed(exc: Exception, code: int = 2) -> None:
    """A :class:`raylane.session.ConnectError`: said in one line. When ``ray.init`` is still
    stuck in its thread, leave at once: Ray's exit hooks would wait on it."""
    import os

    if getattr(exc, "stuck", False):
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _fail(str(exc), code)


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
        _connect_failed(exc)
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
        _fail(str(exc))
    title = f"{spec.name}: config keys (--set key=value)"
    console.print(tables.config_keys(title, cfg.describe(spec.config_cls), console.width, wide=wide))


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
    from raylane.launch import load_job_config, run_job, summary_line

    try:
        spec = registry.get(job)
        conf = load_job_config(spec, config_file=config, overrides=set_, run_name=run_name, progress=progress)
    except (registry.UnknownJobError, cfg.ConfigError) as exc:
        _fail(str(exc))
    try:
        summary = run_job(spec, conf, address=address, dashboard=dashboard, new=new, resume_with_changes=resume_with_changes)
    except cfg.ConfigError as exc:  # the job's input (data, graph, env) refused before Ray starts
        _fail(str(exc))
    except session.ConnectError as exc:  # --address: nothing there, or no handshake within the deadline
        _connect_failed(exc)
    except RunAborted as exc:
        _fail(str(exc), code=130)
    except DriverError as exc:
        _fail(str(exc), code=1)
    if summary["state"] == "stopped":
        console.print(summary_line(spec.name, summary), highlight=False, markup=False)
        console.print(f"run folder: {summary['run_dir']}")
        _end(130 if "SIGINT" in str(summary.get("stop_reason")) else 0)  # 130: as a shell reports a program ended by Ctrl-C
        return
    console.print(summary_line(spec.name, summary), highlight=False, markup=False)
    console.print(f"run folder: {summary['run_dir']}")
    _end(0)


def _end(code: int) -> None:
    """Leave with ``code`` once Ray is shut down, or without waiting for it when the shutdown
    stalls: a signal to the whole process group may be stopping the embedded Ray right now,
    and a shutdown against it would wait out the core worker's 60 s reconnect."""
    import os

    from raylane import session

    if not session.shutdown_within(8.0):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)


from raylane import cli_control  # noqa: E402 - the commands that talk to a running job

cli_control.register(app)
from raylane import cli_submit, cli_tune, devcluster  # noqa: E402 - Ray Jobs API commands; searches; the local dev cluster
cli_submit.register(app)
cli_tune.register(app)
devcluster.register(app)


def main() -> None:
    app(prog_name="raylane")


if __name__ == "__main__":
    main()
