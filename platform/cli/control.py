"""``raylane pools RUN`` and ``raylane scale RUN ROLE N``: talking to a running job's driver
through its control channel (:mod:`raylane.control`)."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer
from rich.table import Table

from raylane.cli.app import connect_failed, console, fail

ADDRESS = ("Ray address of the cluster the job runs on (default: where the run's record on this machine says, else RAY_ADDRESS); "
           "given up after RAYLANE_CONNECT_TIMEOUT seconds (30).")


def _connect(address: Optional[str], run: str, cap_s: Optional[float] = None) -> None:
    """Join the cluster within RAYLANE_CONNECT_TIMEOUT (or ``cap_s``, when shorter); a failure
    is one line on stderr and exit code 2."""
    # the token at hand is sent even without RAY_AUTH_MODE=token: raylane.raystate.prefer_token_auth
    from raylane import session
    from raylane.control import local_address, runs_home

    if not address and run:
        # The run's own record says where it runs; "auto" would join whatever Ray this host
        # has, which may be another cluster that knows nothing of the run.
        address = local_address(run) or os.environ.get("RAY_ADDRESS")
        if not address:
            fail(f"run {run!r} is not running on this machine (no record of it under {runs_home()}) and RAY_ADDRESS is not set; "
                 "give --address of the cluster it runs on (e.g. --address 10.0.0.5:6379, or auto for the cluster on this machine)")
    address = address or "auto"
    try:
        session.connect(address, timeout_s=min(session.connect_timeout_s(), cap_s or float("inf")))
    except session.ConnectError as exc:
        connect_failed(exc)


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def pools(
    run: str = typer.Argument(..., help="The run name (shown by `raylane run` and in runs/)."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Show every pool of a running job: target and live size, nodes, markets, utilisation, evictions."""
    _connect(address, run)  # first: it sets up the token before Ray is imported
    from raylane.control import ControlClient, ControlError

    try:
        report = ControlClient().pools(run)
    except ControlError as exc:
        fail(str(exc))
    if as_json:
        console.print_json(json.dumps(report))
        return
    table = Table(title=f"{run}: pools at step {report['step']} ({_age(report['time'])})")
    for col in ("role", "target", "live", "busy"):
        table.add_column(col, no_wrap=True)
    table.add_column("nodes (actors)", overflow="fold")
    table.add_column("evictions", overflow="fold")
    for role, p in report["pools"].items():
        target = f"{p['target']} of {p['lo']}..{p['hi']}" + (" auto" if p.get("autoscale") else "")
        if p["wanted"] != p["target"]:
            target += f", wants {p['wanted']}"
        live = f"{p['live']}" + (f" +{p['starting']}" if p["starting"] else "")
        nodes = ", ".join(f"{n[:8]} ({c})" for n, c in sorted(p["nodes"].items()))
        markets = ", ".join(f"{c} {m}" for m, c in sorted(p["markets"].items()))
        ev = p["evictions"]
        evictions = f"{len(ev)}; last {_age(ev[-1]['at'])}: {ev[-1]['reason']}" if ev else "none"
        table.add_row(role, target, live, f"{p['busy_fraction']:.0%}", f"{nodes}; {markets}" if nodes else "-", evictions)
        if p.get("placement_error"):
            table.add_row("", "", "", "", f"[yellow]{p['placement_error']}[/yellow]", "")
    console.print(table)


def scale(
    run: str = typer.Argument(..., help="The run name."),
    role: str = typer.Argument(..., help="The pool's role (see `raylane pools RUN`)."),
    n: int = typer.Argument(..., help="The new number of actors."),
    address: Optional[str] = typer.Option(None, help=ADDRESS),
    timeout: float = typer.Option(300.0, help="Seconds to wait for the pool to reach N live actors."),
) -> None:
    """Set a pool's size; returns once N actors are live, or says why they cannot be."""
    started = time.monotonic()
    _connect(address, run, cap_s=timeout)  # first: it sets up the token before Ray is imported
    timeout = max(1.0, timeout - (time.monotonic() - started))  # --timeout covers connecting too
    from raylane.control import ControlClient, ControlError

    client = ControlClient()
    try:
        pool = client.scale(run, role, n, timeout_s=timeout, on_update=lambda msg: console.print(msg))
    except ControlError as exc:
        fail(str(exc), 3 if "no room" in str(exc) or "did not reach" in str(exc) else 2)
    markets = ", ".join(f"{m} {c}" for m, c in sorted(pool["markets"].items()))
    console.print(f"{role}: {pool['live']} live ({markets})")


def notices(
    provider: str = typer.Option(..., help="Cloud whose preemption notice to watch: aws, gcp or azure."),
    interval: float = typer.Option(5.0, help="Seconds between polls of the metadata service."),
    address: Optional[str] = typer.Option(None, help="Ray address of this node's cluster (default: auto)."),
) -> None:
    """Run on a spot node: turn the cloud's preemption notice into a drain of this Ray node."""
    from raylane.notices import POLLERS, NoticeWatcher, make_poller

    if provider not in POLLERS:
        fail(f"unknown provider {provider!r}; choose one of {', '.join(POLLERS)}")
    _connect(address, run="")
    watcher = NoticeWatcher(make_poller(provider), interval_s=interval)
    console.print(f"watching {provider} preemption notices every {interval:g} s")
    notice = watcher.run()
    console.print(f"{notice.provider} {notice.action} notice: drained this node, {max(0.0, notice.deadline - time.time()):.0f} s before the deadline")


def register(app: typer.Typer) -> None:
    app.command()(pools)
    app.command()(scale)
    app.command()(notices)
