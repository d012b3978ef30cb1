"""``raylane submit JOB``, ``status ID``, ``logs ID``, ``stop ID``, ``list``: jobs on a running
Ray cluster through the Ray Jobs API (:mod:`raylane.jobs_client`, :mod:`raylane.submission`).

Exit status: 0 done (with ``--follow``: the job SUCCEEDED), 1 the job FAILED or was
STOPPED, 2 bad input or a cluster that refused or could not be reached (the message
says what to change), 3 a wait that ran out of time.
"""

from __future__ import annotations

import json
import time
from typing import List, Optional

import typer

from raylane.cli.app import fail

ADDRESS = ("The cluster's Jobs API (dashboard) URL, e.g. http://127.0.0.1:8265. Default: $RAY_API_SERVER_ADDRESS, "
           "else the cluster `raylane dev-cluster up` started, else http://127.0.0.1:8265. $RAY_ADDRESS is not used.")


def _warn(message: str) -> None:
    typer.echo(f"warning: {message}", err=True)


def _client(address: Optional[str]):
    from raylane.jobs_client import JobsClient
    from raylane.submission import SubmissionError

    try:
        return JobsClient(address, warn=_warn)
    except SubmissionError as exc:
        fail(str(exc), exc.code)


def _guard(fn):
    """Run one client call; its SubmissionError becomes a one-line error and its exit code."""
    from raylane.submission import SubmissionError

    try:
        return fn()
    except SubmissionError as exc:
        fail(str(exc), exc.code)


def _echo_raw(text: str) -> None:
    typer.echo(text, nl=False)  # log text verbatim: no markup, no added newlines


def _when(t: Optional[float]) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _follow(client, submission_id: str, timeout: Optional[float]) -> None:
    """Stream the job's log until it ends, then say how it ended: its status and, for a
    raylane job, the run summary its driver printed last (final state, steps, metrics)."""
    from raylane.submission import LogTail, final_summary

    tail = LogTail(_echo_raw)
    status = _guard(lambda: client.follow(submission_id, tail, timeout_s=timeout))
    _ended(submission_id, status, client, final_summary(tail.text))


def _ended(submission_id: str, status: str, client, summary: Optional[str] = None) -> None:
    typer.echo(f"\n{submission_id}: {status}" + (f" ({summary})" if summary else ""), err=True)
    if status != "SUCCEEDED":
        info = _guard(lambda: client.info(submission_id))
        if info.message:
            typer.echo(info.message.strip(), err=True)
        raise typer.Exit(1)


def submit(
    job: str = typer.Argument(..., help="The job to run: a registered name (see `raylane jobs`), path/to/file.py:NAME or package.module:NAME (its folder is shipped)."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file with config overrides (read here, sent as --set values)."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Override a config key: key=value (repeatable)."),
    run_name: Optional[str] = typer.Option(None, help="Run name; the same name again resumes from its latest checkpoint."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream the logs until the job ends, then print its final status and run summary (steps, metrics); exit 1 unless it SUCCEEDED."),
    timeout: Optional[float] = typer.Option(None, help="With --follow: give up waiting after this many seconds (the job keeps running)."),
) -> None:
    """Submit a job to a Ray cluster; prints its submission id. The config is checked here before anything is sent.

    The cluster is --address, else $RAY_API_SERVER_ADDRESS, else the dev cluster; $RAY_ADDRESS is
    not used (a warning says so when it names somewhere else), and the job joins the cluster it runs on."""
    from raylane import config as cfg
    from raylane import registry
    from raylane.prepare import job_config
    from raylane.submission import config_overrides

    try:
        spec = registry.get(job)
        job_config(spec, config_file=config, overrides=set_, run_name=run_name)  # refuse a bad config here, not on the cluster
        overrides = config_overrides(config, set_)
    except (registry.UnknownJobError, cfg.ConfigError) as exc:
        fail(str(exc))
    client = _client(address)
    # A registered job runs as installed on the cluster; a job of the user's own file or
    # module is shipped with it (raylane.submission.shipped).
    target = job if ":" in job else spec.name
    submission_id = _guard(lambda: client.submit(target, overrides, run_name=run_name, name=spec.name))
    typer.echo(f"submitted {spec.name} as {submission_id} to {client.url}")
    if not follow:
        typer.echo(f"watch: raylane logs {submission_id} --follow   status: raylane status {submission_id}   stop: raylane stop {submission_id}", err=True)
        return
    _follow(client, submission_id, timeout)


def status(
    submission_id: str = typer.Argument(..., help="The submission id `raylane submit` printed."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    as_json: bool = typer.Option(False, "--json", help="Print the job's record as JSON."),
) -> None:
    """Show a submitted job's status, times and entrypoint."""
    client = _client(address)
    info = _guard(lambda: client.info(submission_id))
    if as_json:
        typer.echo(json.dumps(info.to_json(), indent=2))
        return
    typer.echo(f"{info.submission_id}: {info.status}")
    typer.echo(f"  job:        {info.metadata.get('raylane.job', '-')}" + (f" (run {info.metadata['raylane.run_name']})" if "raylane.run_name" in info.metadata else ""))
    typer.echo(f"  started:    {_when(info.start_time)}")
    typer.echo(f"  ended:      {_when(info.end_time)}")
    typer.echo(f"  entrypoint: {info.entrypoint}")
    if info.message:
        typer.echo(f"  message:    {info.message.strip()}")


def logs(
    submission_id: str = typer.Argument(..., help="The submission id."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep streaming until the job ends; exit 1 unless it SUCCEEDED."),
    timeout: Optional[float] = typer.Option(None, help="With --follow: give up waiting after this many seconds."),
) -> None:
    """Print a submitted job's logs (driver output)."""
    client = _client(address)
    if not follow:
        _echo_raw(_guard(lambda: client.logs(submission_id)))
        return
    _follow(client, submission_id, timeout)


def stop(
    submission_id: str = typer.Argument(..., help="The submission id."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    wait: float = typer.Option(60.0, help="Seconds to wait for the job to end."),
) -> None:
    """Stop a submitted job and wait until it has ended."""
    client = _client(address)
    final = _guard(lambda: client.stop(submission_id, wait_s=wait))
    typer.echo(f"{submission_id}: {final}")


def list_jobs(
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    as_json: bool = typer.Option(False, "--json", help="Print the jobs as JSON."),
) -> None:
    """List the jobs submitted to the cluster, oldest first."""
    client = _client(address)
    jobs = _guard(client.list_jobs)
    if as_json:
        typer.echo(json.dumps([j.to_json() for j in jobs], indent=2))
        return
    # Plain columns, never cut: ids are what users copy into `status`/`stop`, and lines grep well.
    typer.echo(f"{len(jobs)} job(s) on {client.url}")
    width = max([len(j.submission_id) for j in jobs] + [13])
    typer.echo(f"{'submission id':<{width}}  {'status':<9}  {'job':<11}  {'started':<19}  entrypoint")
    for j in jobs:
        typer.echo(f"{j.submission_id:<{width}}  {j.status:<9}  {j.metadata.get('raylane.job', '-'):<11}  {_when(j.start_time):<19}  {j.entrypoint}")


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command()(status)
    app.command()(logs)
    app.command()(stop)
    app.command("list")(list_jobs)
