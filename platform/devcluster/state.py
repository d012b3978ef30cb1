"""What ``raylane dev-cluster up`` recorded, and how to connect to that cluster.

The record lives in ``<dir>/state.json`` (default ``~/.raylane/dev-cluster``, or
``RAYLANE_DEV_CLUSTER_DIR``): ``down`` and ``status`` read it, and ``raylane submit``
reads it to find the cluster when no ``--address`` is given. ``<dir>/connection.env``
holds the same in the variables Ray's own tools read (:func:`connection_env`):
``set -a; . <dir>/connection.env; set +a``.

Nothing here starts or stops a process (that is :mod:`raylane.devcluster.nodes`), so
the submit path can read the record without importing the CLI.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raylane import security

DIR_ENV = "RAYLANE_DEV_CLUSTER_DIR"
MARKER_ENV = "RAYLANE_DEV_CLUSTER_ID"
CONNECTION_FILE = "connection.env"


class DevClusterError(RuntimeError):
    """The dev cluster could not be started, found or stopped; the message says why."""


@dataclass
class NodeRecord:
    name: str
    market: str
    speed: float
    cpus: int
    is_head: bool = False


@dataclass
class DevClusterState:
    """What ``up`` started, written to ``<dir>/state.json`` for ``down``, ``status`` and ``submit``."""

    cluster_id: str
    gcs_address: str
    dashboard_url: str
    dashboard_host: str
    temp_dir: str
    auth_mode: str
    token_source: str | None
    token_path: str | None = None
    """The token file the cluster reads (never the token itself), for `status` when none is set here."""
    workdir: str = ""
    """Where job drivers start (the directory `up` ran in): relative run folders land under it."""
    nodes: list[NodeRecord] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @classmethod
    def load(cls, state_dir: Path) -> "DevClusterState | None":
        path = state_dir / "state.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise DevClusterError(f"{path} is not a dev-cluster record ({exc}); remove it if no dev cluster runs") from None
        raw["nodes"] = [NodeRecord(**n) for n in raw.get("nodes", [])]
        return cls(**raw)

    def save(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")
        tmp.replace(state_dir / "state.json")  # atomic: a reader never sees half a record


def default_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".raylane" / "dev-cluster").expanduser()


def connection_env(state: DevClusterState) -> dict[str, str]:
    """The variables that point Ray's tools and raylane at this cluster.

    ``RAY_ADDRESS`` is the GCS (what ``ray.init``, ``ray status`` and ``raylane cluster``
    join); ``RAY_API_SERVER_ADDRESS`` is the Jobs API, which ``ray job`` reads before its
    ``--address`` and before ``RAY_ADDRESS``, as ``raylane submit`` does; with token
    authentication, ``RAY_AUTH_MODE=token`` (without it Ray's clients send no token) and
    the token file (never the token itself).
    """
    env = {"RAY_ADDRESS": state.gcs_address, "RAY_API_SERVER_ADDRESS": state.dashboard_url, security.AUTH_MODE_ENV: state.auth_mode}
    if state.auth_mode == "token" and state.token_path:
        env[security.TOKEN_PATH_ENV] = state.token_path
    return env


def submit_command(state: DevClusterState, job_module: str = "raylane.jobs.linreg") -> str:
    """The ``ray job submit`` command line for this cluster, its variables set in front, so a
    RAY_ADDRESS or RAY_API_SERVER_ADDRESS already in the shell cannot send it elsewhere.
    No ``--working-dir``: every node runs this interpreter, which has raylane, and the
    driver starts in the directory ``up`` ran in, where the run folders are."""
    env = connection_env(state)
    # Not RAY_ADDRESS (the GCS): `ray job` does not need it, and RAY_API_SERVER_ADDRESS wins over it anyway.
    names = [security.AUTH_MODE_ENV, "RAY_API_SERVER_ADDRESS", security.TOKEN_PATH_ENV]
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in names if k in env)
    return f"{prefix} ray job submit -- python -m {job_module}"


def write_connection_file(state: DevClusterState, state_dir: Path) -> Path:
    path = state_dir / CONNECTION_FILE
    lines = [f"# raylane dev cluster {state.cluster_id}, written by `raylane dev-cluster up`; removed by `down`.",
             f"# Load it into a shell with: set -a; . {shlex.quote(str(path))}; set +a"]
    if state.auth_mode == "token" and not state.token_path:
        lines.append(f"# The token comes from {state.token_source}; keep it set where you use this file.")
    lines += [f"{k}={shlex.quote(v)}" for k, v in connection_env(state).items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
