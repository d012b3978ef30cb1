"""``raylane dev-cluster up|down|status``: a real multi-node Ray cluster on this machine.

``up`` starts an on-demand head that does no training work and labelled spot and
on-demand worker nodes, token-protected, so placement, spot preference and
``raylane submit`` can be tried end to end before a cloud is involved; ``down`` stops
exactly what ``up`` started, and nothing else; ``status`` shows the record and which
nodes Ray lists as alive. This module is the command line only; the cluster itself is
:mod:`raylane.devcluster`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer

from raylane import security
from raylane.cli.app import fail
from raylane.cluster import MARKET_LABEL, SPEED_LABEL
from raylane.devcluster.nodes import down, live_nodes, processes, up
from raylane.devcluster.state import CONNECTION_FILE, DIR_ENV, DevClusterError, DevClusterState, default_dir, submit_command

dev_app = typer.Typer(help="A local multi-node Ray cluster (real `ray start` processes) to try raylane submit on.", no_args_is_help=True)
DIR_HELP = "Where the dev cluster's record and logs live."


def _dir_option() -> Path:
    return typer.Option(None, "--dir", envvar=DIR_ENV, help=DIR_HELP + " Default: ~/.raylane/dev-cluster.", show_default=False)


@dev_app.command("up")
def up_cmd(
    spot: int = typer.Option(1, help="Spot worker nodes (label ray.io/market-type=spot)."),
    ondemand: int = typer.Option(1, help="On-demand worker nodes (label ray.io/market-type=on-demand)."),
    cpus: int = typer.Option(2, help="CPUs each worker node offers."),
    head_cpus: int = typer.Option(0, help="CPUs the head offers (0: no training work on the head, as in deploy/)."),
    spot_speed: float = typer.Option(1.0, help="raylane.io/speed label of the spot nodes."),
    ondemand_speed: float = typer.Option(1.0, help="raylane.io/speed label of the on-demand nodes."),
    dashboard_host: str = typer.Option("127.0.0.1", help="Address the dashboard and Jobs API bind to (only they: the GCS and raylets listen on all interfaces). Anything but loopback needs token authentication."),
    object_store_mb: int = typer.Option(256, help="Object store size per node, MiB."),
    timeout: float = typer.Option(120.0, help="Seconds to wait for every node to be up."),
    state_dir: Optional[Path] = _dir_option(),
) -> None:
    """Start a head and worker nodes on this machine: labelled and token-protected.

    The dashboard and Jobs API listen on --dashboard-host (127.0.0.1 by default); Ray's GCS, raylets and node agents listen on all interfaces, as `ray start` has them on Linux, and answer only with the cluster's token (with RAY_AUTH_MODE=disabled: to anyone).

    The addresses and the token file's path are written to <dir>/connection.env."""
    try:
        state = up(spot, ondemand, cpus=cpus, head_cpus=head_cpus, spot_speed=spot_speed, ondemand_speed=ondemand_speed,
                   dashboard_host=dashboard_host, object_store_mb=object_store_mb, state_dir=state_dir, timeout_s=timeout,
                   log=typer.echo, warn=lambda m: typer.echo(f"warning: {m}", err=True))
    except (DevClusterError, security.SecurityError) as exc:
        fail(str(exc))
    state_dir = state_dir or default_dir()
    _print_state(state, state_dir)
    auth = f"{security.AUTH_MODE_ENV}={state.auth_mode}"
    typer.echo(f"\nconnection:     {state_dir / CONNECTION_FILE}   (load it: set -a; . {shlex.quote(str(state_dir / CONNECTION_FILE))}; set +a)")
    typer.echo(f"submit a job:   raylane submit linreg --follow      (finds this cluster through {state_dir})")
    typer.echo(f"from Ray's CLI: {submit_command(state)}")
    typer.echo(f"cluster view:   {auth} raylane cluster --address {state.gcs_address}")
    typer.echo("stop it:        raylane dev-cluster down")


def _print_state(state: DevClusterState, state_dir: Path) -> None:
    token = None
    try:
        token = security.find_token()
    except security.SecurityError:
        pass
    if token is None and state.token_path and Path(state.token_path).exists():
        token = security.Token(Path(state.token_path).read_text(encoding="utf-8").strip(), state.token_path, Path(state.token_path))
    try:
        nodes = {n.get("node_name"): n for n in live_nodes(state, token)}
    except Exception as exc:  # status must still print what was recorded when the cluster is unreachable
        nodes = {}
        typer.echo(f"warning: the state API at {state.dashboard_url} did not answer: {exc}", err=True)
    typer.echo(f"dev cluster {state.cluster_id}: Jobs API {state.dashboard_url}, GCS {state.gcs_address}, "
               f"auth {state.auth_mode}" + (f" (token from {state.token_source})" if state.token_source else ""))
    if state.workdir:
        typer.echo(f"job drivers start in {state.workdir}: a job's run folder runs/<run name> is under it")
    typer.echo(f"{'node':<14}{'market':<11}{'speed':<7}{'CPU':<5}{'node id':<14}status")
    for rec in state.nodes:
        live = nodes.get(rec.name)
        labels = (live or {}).get("labels") or {}
        typer.echo(f"{rec.name:<14}{labels.get(MARKET_LABEL, rec.market):<11}{labels.get(SPEED_LABEL, f'{rec.speed:g}'):<7}"
                   f"{rec.cpus:<5}{(live or {}).get('node_id', '-')[:12]:<14}{'alive' if live else 'not listed'}")


@dev_app.command("down")
def down_cmd(
    grace: float = typer.Option(5.0, help="Seconds between SIGTERM and SIGKILL."),
    keep_logs: bool = typer.Option(False, help="Keep the Ray temp dir (session logs)."),
    state_dir: Optional[Path] = _dir_option(),
) -> None:
    """Stop exactly the processes `dev-cluster up` started (never other Ray clusters on the machine)."""
    try:
        down(state_dir, grace_s=grace, keep_logs=keep_logs, log=typer.echo)
    except DevClusterError as exc:
        fail(str(exc), code=1)


@dev_app.command("status")
def status_cmd(state_dir: Optional[Path] = _dir_option()) -> None:
    """Show the recorded dev cluster and which of its nodes Ray lists as alive."""
    state_dir = state_dir or default_dir()
    try:
        state = DevClusterState.load(state_dir)
    except DevClusterError as exc:
        fail(str(exc))
    if state is None:
        fail(f"no dev cluster recorded in {state_dir}; `raylane dev-cluster up` starts one", code=1)
    alive = len(processes(state.cluster_id))
    _print_state(state, state_dir)
    if (state_dir / CONNECTION_FILE).exists():
        typer.echo(f"connection: {state_dir / CONNECTION_FILE}")
    typer.echo(f"{alive} live process(es)")


def register(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev-cluster")
