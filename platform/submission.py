"""Submitting raylane jobs to a running Ray cluster: what is sent, where to, and what came back.

A submitted job is the same command a user could type on the cluster,
``python -m raylane.jobs.<job> --set ... --run-name ... --no-progress`` (see
:func:`raylane.launch.job_main`), so ``raylane submit`` and ``ray job submit`` run
the same thing. The config is validated here first; the cluster validates it again
against the raylane it has installed.

A ``--config FILE`` is local to the submitter, so it is not sent as a file: its keys
are flattened into ``--set key=value`` pairs placed before the user's own ``--set``
overrides, which builds exactly the nested mapping the file would have
(:func:`config_overrides`).

Where jobs go is decided here, never by Ray (:func:`resolve_address`): ``--address``,
else $RAY_API_SERVER_ADDRESS, else the recorded dev cluster, else Ray's default. Ray's
``JobSubmissionClient`` lets $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, override the
address it is given, so a ``RAY_ADDRESS=local`` left in a shell (or an ``auto``, or a
GCS address) made it look up a GCS on this machine and ask it over gRPC for the
dashboard, without raylane's token. :mod:`raylane.jobs_client` builds the client with
$RAY_API_SERVER_ADDRESS set to the URL resolved here, and warns when $RAY_ADDRESS names
another place (:func:`ambient_address_note`). The job's driver is not affected either
way: the cluster's job supervisor sets its RAY_ADDRESS to the cluster's own GCS, so it
always joins the cluster it was submitted to.

A job of the user's own (``path/to/file.py:NAME`` or ``package.module:NAME``) is not
installed on the cluster: the folder holding it travels as a runtime_env ``py_modules``
package (:func:`shipped`), on the import path of the job's driver and of its workers, and
the job runs ``python -m raylane run package.module:NAME --address auto``. The job's
working folder stays the cluster's own, so its ``runs/`` lands where a registered job's does.

The calls themselves, each with a deadline and every error a :class:`SubmissionError`
with one sentence on what to do, are :class:`raylane.jobs_client.JobsClient`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit


from raylane import config as cfg
from raylane.devcluster import state as devcluster_state

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"  # what `ray job submit` reads too
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # where a Ray driver joins; `ray job submit` falls back on it, raylane does not


class SubmissionError(RuntimeError):
    """A submission or a query failed; ``code`` is the exit status the CLI uses (2: fix the input, 3: timed out)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------- what is submitted

def job_module(job: str) -> str:
    """The module ``python -m`` runs for ``job``: the one its ``raylane.jobs`` entry point names."""
    for ep in entry_points(group="raylane.jobs"):
        if ep.name == job:
            return ep.module
    raise SubmissionError(f"job {job!r} has no raylane.jobs entry point (see `raylane jobs`)")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out += _flatten(value, dotted)
        else:
            # JSON is YAML, and it keeps a string a string ("2024-05-01", "123", "on")
            # where a bare value would be re-read as a date, a number or a bool.
            out.append(f"{dotted}={json.dumps(value, default=str)}")
    return out


def config_overrides(config_file: str | None, overrides: Sequence[str]) -> list[str]:
    """``--set`` values for the cluster: the file's keys flattened, then the user's overrides.

    >>> config_overrides(None, ["workers=2"])
    ['workers=2']
    """
    out: list[str] = []
    if config_file is not None:
        out += _flatten(cfg.read_mapping(config_file))  # the one YAML reader: duplicate keys, octal and aliases refused
    return out + list(overrides)


def shipped(job: str) -> tuple[str, list[str]]:
    """A user's job as the cluster names it, and the folders to ship as ``py_modules``:
    ``path/to/file.py:NAME`` ships ``path/to`` as the package ``to`` (the cluster runs
    ``to.file:NAME``); ``package.module:NAME`` ships the folder of ``package``."""
    where, _, name = job.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).resolve()
        folder = path.parent
        if not folder.name.isidentifier() or not path.stem.isidentifier():
            raise SubmissionError(f"job {job!r}: the folder {folder.name!r} travels to the cluster as a Python package holding module "
                                  f"{path.stem!r}; both names must be Python identifiers: rename them, or install the job as a package")
        return f"{folder.name}.{path.stem}:{name}", [str(folder)]
    top = where.split(".")[0]
    try:
        folders = list(getattr(importlib.import_module(top), "__path__", []))
    except ImportError as exc:
        raise SubmissionError(f"job {job!r}: {top!r} does not import here ({exc}); submit from the folder that holds it") from None
    if not folders:
        raise SubmissionError(f"job {job!r}: {top!r} is a single-file module; submit it as path/to/{top}.py:{name}, or put it in a package folder")
    return job, [folders[0]]


def entrypoint(job: str, overrides: Sequence[str], run_name: str | None = None, python: str = "python") -> str:
    """The shell command the cluster runs; every argument quoted, so a value is never split or expanded.
    ``job`` is a registered name, or a user's ``package.module:NAME`` as :func:`shipped` gives it."""
    argv = [python, "-m", "raylane", "run", job, "--address", "auto"] if ":" in job else [python, "-m", job_module(job)]
    for item in overrides:
        argv += ["--set", item]
    if run_name is not None:
        argv += ["--run-name", run_name]
    return shlex.join(argv + ["--no-progress"])  # a progress bar is noise in a log file


# ------------------------------------------------------------------------------ what came back

# The line a raylane job's driver prints when its run ends (raylane.launch.summary_line),
# the same one `raylane run` prints: "linreg: finished after 5 steps in 1.8 s; loss=0.0101, ...".
_SUMMARY_LINE = re.compile(r"^(?P<job>[\w.-]+): (?P<rest>finished after \d+ steps\b.*|stopped at step \d+\b.*)$", re.M)


def final_summary(log_text: str) -> str | None:
    """The run summary at the end of a raylane job's log, as ``JOB finished after ...``; None when there is none.

    >>> final_summary("step 1\\nlinreg: finished after 5 steps in 1.8 s; loss=0.0101\\nrun folder: runs/a\\n")
    'linreg finished after 5 steps in 1.8 s; loss=0.0101'
    """
    found = list(_SUMMARY_LINE.finditer(log_text.replace("\r\n", "\n")))
    return f"{found[-1]['job']} {found[-1]['rest'].strip()}" if found else None


class LogTail:
    """Passes log text on to ``out`` and keeps its last ``keep`` characters, where a job's summary is.

    >>> tail = LogTail(lambda _t: None, keep=8)
    >>> tail("0123456789"); tail.text
    '23456789'
    """

    def __init__(self, out: Callable[[str], None], keep: int = 65536):
        self.out, self.keep, self.text = out, keep, ""

    def __call__(self, chunk: str) -> None:
        self.out(chunk)
        self.text = (self.text + chunk)[-self.keep:]


# ------------------------------------------------------------------------------ where to
# ------------------------------------------------------------------------------ where to

def resolve_address(address: str | None) -> tuple[str, str]:
    """``(url, where it came from)``: ``--address``, else $RAY_API_SERVER_ADDRESS, else the
    dev cluster recorded by ``raylane dev-cluster up``, else Ray's default http://127.0.0.1:8265."""
    if address:
        return normalize_address(address, "--address"), "--address"
    if os.environ.get(ADDRESS_ENV):
        return normalize_address(os.environ[ADDRESS_ENV], ADDRESS_ENV), ADDRESS_ENV
    try:
        state = devcluster_state.DevClusterState.load(devcluster_state.default_dir())
    except devcluster_state.DevClusterError:
        state = None
    if state is not None:
        return state.dashboard_url, f"the dev cluster recorded in {devcluster_state.default_dir()}"
    return DEFAULT_ADDRESS, "the default"


def dev_cluster_gcs(url: str) -> list[str]:
    """The GCS address of the recorded dev cluster when ``url`` is its Jobs API: the same cluster."""
    try:
        state = devcluster_state.DevClusterState.load(devcluster_state.default_dir())
    except devcluster_state.DevClusterError:
        return []
    return [state.gcs_address] if state is not None and state.dashboard_url == url else []


def normalize_address(text: str, name: str = "--address") -> str:
    """``127.0.0.1:8265`` -> ``http://127.0.0.1:8265``; anything that is not a Jobs API URL is refused."""
    raw = text.strip()
    if raw in ("auto", "local"):
        raise SubmissionError(f"{name} {text!r}: the Jobs API needs the dashboard's URL, e.g. http://127.0.0.1:8265 "
                              "(`raylane dev-cluster status` or `ray status` on the head shows it)")
    url = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise SubmissionError(f"{name} {text!r} is not a Jobs API address; give the dashboard's URL, e.g. http://127.0.0.1:8265")
    if port in (6379, 10001):
        raise SubmissionError(f"{name} {text!r}: port {port} is Ray's {'GCS' if port == 6379 else 'client server'}, not the "
                              "Jobs API; give the dashboard's URL, e.g. http://127.0.0.1:8265")
    return url.rstrip("/")


def _hostport(address: str) -> str:
    parts = urlsplit(address.strip() if "://" in address else f"//{address.strip()}")
    try:
        return f"{(parts.hostname or '').lower()}:{parts.port}"
    except ValueError:
        return address.strip().lower()


def ambient_address_note(url: str, env: Mapping[str, str] | None = None, same_cluster: Sequence[str] = ()) -> str | None:
    """A warning when $RAY_ADDRESS names somewhere other than ``url`` (or ``same_cluster``,
    e.g. the GCS of the dev cluster behind ``url``): raylane submits to ``url`` regardless.

    >>> ambient_address_note("http://127.0.0.1:8265", {"RAY_ADDRESS": "local"})[:36]
    "RAY_ADDRESS='local' is not used here"
    >>> ambient_address_note("http://127.0.0.1:8265", {"RAY_ADDRESS": "127.0.0.1:8265"}) is None
    True
    """
    env = os.environ if env is None else env
    value = env.get(RAY_ADDRESS_ENV, "").strip()
    if not value or _hostport(value) in {_hostport(a) for a in (url, *same_cluster)}:
        return None
    return (f"{RAY_ADDRESS_ENV}={value!r} is not used here: raylane sends jobs to the Jobs API at {url} (--address, "
            f"${ADDRESS_ENV} or the dev cluster choose it). {RAY_ADDRESS_ENV} says which Ray a driver joins "
            "('local': a private one), and the submitted job joins the cluster it runs on whatever this shell says.")
