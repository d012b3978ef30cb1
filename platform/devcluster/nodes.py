"""Starting and stopping the processes of ``raylane dev-cluster``: a real multi-node Ray cluster on this machine.

:func:`up` runs ``ray start`` once for an on-demand head that does no training work
(0 CPUs, like the head of ``deploy/cluster.yaml``) and once per worker node, each
labelled with its market and speed, so placement, spot preference and
``raylane submit`` can be tried end to end before a cloud is involved. Everything is
as on a real cluster: token authentication on, a Ray temp dir of its own, free ports
picked at start (never Ray's defaults, which another Ray on the machine may hold).

What listens where: the dashboard and its Jobs API bind to ``--dashboard-host``
(127.0.0.1 by default). The GCS, the raylets and the node agents listen on every
interface, as ``ray start`` always has them on Linux, and answer only with the token.
They cannot be kept to loopback: ``ray start --node-ip-address=127.0.0.1`` is turned
into the machine's IP by Ray, and the setting that keeps an embedded Ray on loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, see :class:`raylane.join.loopback_node`)
makes ``ray start`` refuse to add worker nodes.

:func:`down` stops exactly what ``up`` started, and nothing else: every process ``up``
starts carries ``RAYLANE_DEV_CLUSTER_ID=<id>`` in its environment, which Ray hands
on to everything it spawns (raylets, workers, job drivers), so the processes to stop
are found by that marker, plus their descendants. ``ray stop`` is never used: it
stops every Ray on the machine.

What ``up`` started is recorded as it starts (:mod:`raylane.devcluster.state`), so
``down`` can always find it.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from raylane import security
from raylane.cluster import MARKET_LABEL, SPEED_LABEL
from raylane.devcluster.state import CONNECTION_FILE, MARKER_ENV, DevClusterError, DevClusterState, NodeRecord, default_dir, write_connection_file

MAX_NODES = 16


def _free_port(taken: set[int]) -> int:
    # Bound on all interfaces: Ray's GCS and agents listen there, so a port free only on
    # loopback would still collide.
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port
    raise DevClusterError("could not find a free TCP port")


def _ray_executable() -> str:
    # The `ray` next to this interpreter: the cluster must run the same Ray and raylane.
    sibling = Path(sys.executable).with_name("ray")
    found = str(sibling) if sibling.exists() else shutil.which("ray")
    if not found:
        raise DevClusterError(f"no `ray` executable beside {sys.executable} or on PATH; install ray[default] in this environment")
    return found


def _labels(market: str, speed: float) -> str:
    return f"{MARKET_LABEL}={market},{SPEED_LABEL}={speed:g}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def processes(cluster_id: str) -> list:
    """Every live process of the dev cluster ``cluster_id``: those carrying its marker, and their descendants."""
    import psutil

    marked = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) == cluster_id and proc.status() != psutil.STATUS_ZOMBIE:
                marked[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for proc in list(marked.values()):
        try:
            for child in proc.children(recursive=True):
                if child.status() != psutil.STATUS_ZOMBIE:
                    marked.setdefault(child.pid, child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return list(marked.values())


def _validate(spot: int, ondemand: int, cpus: int, head_cpus: int, spot_speed: float, ondemand_speed: float, object_store_mb: int) -> None:
    problems = []
    if spot < 0 or ondemand < 0:
        problems.append(f"--spot {spot} / --ondemand {ondemand}: node counts must be >= 0")
    if spot + ondemand > MAX_NODES:
        problems.append(f"--spot {spot} + --ondemand {ondemand} = {spot + ondemand} worker nodes; at most {MAX_NODES} on one machine")
    if cpus < 1:
        problems.append(f"--cpus {cpus}: each worker node needs >= 1 CPU")
    if head_cpus < 0:
        problems.append(f"--head-cpus {head_cpus}: must be >= 0 (0 keeps training work off the head)")
    for name, speed in (("--spot-speed", spot_speed), ("--ondemand-speed", ondemand_speed)):
        if not (math.isfinite(speed) and speed > 0):
            problems.append(f"{name} {speed}: must be a finite number > 0 (a relative speed such as 1 or 2.5)")
    if object_store_mb < 80:
        problems.append(f"--object-store-mb {object_store_mb}: Ray needs at least 80 MiB per node")
    if problems:
        raise DevClusterError("; ".join(problems))


def up(
    spot: int = 1,
    ondemand: int = 1,
    *,
    cpus: int = 2,
    head_cpus: int = 0,
    spot_speed: float = 1.0,
    ondemand_speed: float = 1.0,
    dashboard_host: str = "127.0.0.1",
    object_store_mb: int = 256,
    state_dir: Path | None = None,
    timeout_s: float = 120.0,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] = print,
) -> DevClusterState:
    """Start a head and ``spot`` + ``ondemand`` worker nodes; returns once Ray lists them all with their labels."""
    _validate(spot, ondemand, cpus, head_cpus, spot_speed, ondemand_speed, object_store_mb)
    state_dir = state_dir or default_dir()
    old = DevClusterState.load(state_dir)
    if old is not None:
        if processes(old.cluster_id):
            raise DevClusterError(f"a dev cluster is already up (dashboard {old.dashboard_url}, recorded in {state_dir}); "
                                  "`raylane dev-cluster down` first")
        _forget(state_dir, old, keep_logs=False)  # a stale record of a cluster that is gone

    mode = security.auth_mode()
    note = security.check_dashboard_host(dashboard_host, mode)
    if note:
        warn(note)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    token = None
    if mode == "token":
        token = security.find_token()
        if token is None:
            token = security.create_token_file(security.default_token_path())
            log(f"created a new cluster token in {token.path} (mode 600)")
        if token.path is not None:
            problem = security.token_file_warning(token.path)
            if problem:
                warn(problem)
            env[security.TOKEN_PATH_ENV] = str(token.path)
        env[security.AUTH_MODE_ENV] = "token"
    cluster_id = uuid.uuid4().hex[:12]
    env[MARKER_ENV] = cluster_id
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Job entrypoints say `python`: on this cluster that must be this interpreter, which has raylane.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])

    # Short and private: Ray's socket paths must stay under the 107-byte limit of a unix socket.
    temp_dir = tempfile.mkdtemp(prefix=f"rl-dev-{cluster_id[:6]}-", dir="/tmp")
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    taken: set[int] = set()
    gcs_port, dash_port, client_port = _free_port(taken), _free_port(taken), _free_port(taken)
    state = DevClusterState(
        cluster_id=cluster_id,
        gcs_address=f"127.0.0.1:{gcs_port}",
        # Clients on this machine use loopback whenever the bind includes it (0.0.0.0 does).
        dashboard_url=f"http://{'127.0.0.1' if security.is_loopback(dashboard_host) or dashboard_host in ('0.0.0.0', '::') else dashboard_host}:{dash_port}",
        dashboard_host=dashboard_host,
        temp_dir=temp_dir,
        auth_mode=mode,
        token_source=token.source if token else None,
        token_path=str(token.path) if token and token.path else None,
        workdir=os.getcwd(),
    )
    state.save(state_dir)  # before anything starts, so `down` can always find what did
    ray_bin = _ray_executable()
    common = [f"--temp-dir={temp_dir}", f"--object-store-memory={object_store_mb * 2**20}", "--num-gpus=0", "--disable-usage-stats"]
    deadline = time.monotonic() + timeout_s
    try:
        head = NodeRecord("head", "on-demand", ondemand_speed, head_cpus, is_head=True)
        log(f"starting the head (on-demand, {head_cpus} CPU, dashboard {state.dashboard_url}) ...")
        head_cmd = [ray_bin, "start", "--head", f"--port={gcs_port}", f"--dashboard-host={dashboard_host}", f"--dashboard-port={dash_port}",
                    "--include-dashboard=true", f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={_free_port(taken)}",
                    f"--num-cpus={head_cpus}", "--node-name=head", f"--labels={_labels(head.market, head.speed)}", *common]
        _wait_start(_spawn(head_cmd, env, logs / "head.log"), "the head", logs / "head.log", deadline)
        state.nodes.append(head)
        state.save(state_dir)
        workers = [NodeRecord(f"on-demand-{i + 1}", "on-demand", ondemand_speed, cpus) for i in range(ondemand)]
        workers += [NodeRecord(f"spot-{i + 1}", "spot", spot_speed, cpus) for i in range(spot)]
        if workers:
            log(f"starting {len(workers)} worker node(s): {', '.join(w.name for w in workers)} ...")
        for w in workers:
            # One at a time: nodes sharing a temp dir pick their socket names by looking
            # for free ones, and two starting at once can pick the same one.
            cmd = [ray_bin, "start", f"--address={state.gcs_address}", f"--num-cpus={w.cpus}", f"--node-name={w.name}",
                   f"--dashboard-agent-listen-port={_free_port(taken)}", f"--labels={_labels(w.market, w.speed)}", *common]
            _wait_start(_spawn(cmd, env, logs / f"{w.name}.log"), w.name, logs / f"{w.name}.log", deadline)
            state.nodes.append(w)
            state.save(state_dir)
        _wait_for_nodes(state, token, deadline)
        write_connection_file(state, state_dir)
    except DevClusterError as exc:
        down(state_dir, keep_logs=True, log=lambda _m: None)  # stop what did start; keep the logs named here
        raise DevClusterError(f"{exc}\nRay's own logs: {temp_dir}/session_latest/logs") from None
    except BaseException:
        down(state_dir, keep_logs=True, log=lambda _m: None)
        raise
    return state


def _spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    out = open(log_path, "wb")
    try:
        # Its own session: a Ctrl-C in the terminal that ran `up` must not reach the cluster.
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        out.close()


def _wait_start(proc: subprocess.Popen, name: str, log_path: Path, deadline: float) -> None:
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise DevClusterError(f"`ray start` for {name} did not finish in time; its output ({log_path}):\n{_tail(log_path)}") from None
    if rc != 0:
        raise DevClusterError(f"`ray start` for {name} failed (exit {rc}); its output ({log_path}):\n{_tail(log_path)}")


def _headers(token: security.Token | None) -> dict:
    return {"Authorization": f"Bearer {token.value}"} if token else {}


def live_nodes(state: DevClusterState, token: security.Token | None, timeout_s: float = 10.0) -> list[dict]:
    """The alive nodes as Ray's state API lists them (name, labels, resources)."""
    import requests

    r = requests.get(f"{state.dashboard_url}/api/v0/nodes", params={"limit": 1000, "detail": "true"}, headers=_headers(token), timeout=timeout_s)
    r.raise_for_status()
    rows = r.json()["data"]["result"]["result"]
    return [n for n in rows if n.get("state") == "ALIVE"]


def _wait_for_nodes(state: DevClusterState, token: security.Token | None, deadline: float) -> None:
    import requests

    want = {n.name: n for n in state.nodes}
    last = "the dashboard did not answer"
    while time.monotonic() < deadline:
        try:
            nodes = {n.get("node_name"): n for n in live_nodes(state, token)}
            missing = [name for name, rec in want.items()
                       if name not in nodes or (nodes[name].get("labels") or {}).get(MARKET_LABEL) != rec.market]
            if not missing:
                return
            last = f"nodes not yet listed with their labels: {', '.join(missing)}"
        except (requests.RequestException, KeyError, ValueError) as exc:
            last = f"the state API at {state.dashboard_url} answered: {exc}"
        time.sleep(0.5)
    raise DevClusterError(f"the dev cluster did not come up in time: {last}")


def _forget(state_dir: Path, state: DevClusterState, keep_logs: bool) -> None:
    if not keep_logs:
        shutil.rmtree(state.temp_dir, ignore_errors=True)
        shutil.rmtree(state_dir / "logs", ignore_errors=True)
    (state_dir / CONNECTION_FILE).unlink(missing_ok=True)
    (state_dir / "state.json").unlink(missing_ok=True)


def down(state_dir: Path | None = None, *, grace_s: float = 5.0, keep_logs: bool = False, log: Callable[[str], None] = print) -> list[int]:
    """Stop every process of the recorded dev cluster (SIGTERM, then SIGKILL after ``grace_s``); returns their pids."""
    import psutil

    state_dir = state_dir or default_dir()
    state = DevClusterState.load(state_dir)
    if state is None:
        log(f"no dev cluster recorded in {state_dir}; nothing to stop")
        return []
    stopped: list[int] = []
    # A few rounds: a raylet may still spawn a worker while its siblings are stopping.
    for _ in range(5):
        procs = processes(state.cluster_id)
        if not procs:
            break
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5.0)
        stopped += [p.pid for p in procs]
    left = processes(state.cluster_id)
    if left:
        raise DevClusterError(f"could not stop dev-cluster processes {sorted(p.pid for p in left)}; stop them by pid and run down again")
    _forget(state_dir, state, keep_logs)
    log(f"stopped the dev cluster {state.cluster_id}: {len(set(stopped))} process(es)" + (f"; logs kept in {state.temp_dir}" if keep_logs else ""))
    return sorted(set(stopped))
