"""Submitting raylane jobs to a running Ray cluster through the Ray Jobs API.

A submitted job is the same command a user could type on the cluster,
``python -m raylane.jobs.<job> --set ... --run-name ... --no-progress`` (see
:func:`raylane.launch.job_main`), so ``raylane submit`` and ``ray job submit`` run
the same thing. The config is validated here first; the cluster validates it again
against the raylane it has installed.

A ``--config FILE`` is local to the submitter, so it is not sent as a file: its keys
are flattened into ``--set key=value`` pairs placed before the user's own ``--set``
overrides, which builds exactly the nested mapping the file would have
(:func:`config_overrides`).

Where jobs go is decided here, never by Ray: Ray's ``JobSubmissionClient`` lets
$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, override the address it is given, so a
``RAY_ADDRESS=local`` left in a shell (or an ``auto``, or a GCS address) made it look up
a GCS on this machine and ask it over gRPC for the dashboard, without raylane's
token. raylane builds the client with $RAY_API_SERVER_ADDRESS set to the URL it
resolved (:func:`_jobs_api_env`), and warns when $RAY_ADDRESS names another place
(:func:`ambient_address_note`). The job's driver is not affected either way: the
cluster's job supervisor sets its RAY_ADDRESS to the cluster's own GCS, so it always
joins the cluster it was submitted to.

Every call to the cluster has a deadline (:func:`_call`), including the connection
check the Ray client makes when it is created, and every error reaches the user as a
:class:`SubmissionError` with one sentence on what to do: a missing or refused token,
an address nothing listens on, an unknown submission id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import shlex
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml

from raylane import config as cfg
from raylane import security

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"  # what `ray job submit` reads too
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # where a Ray driver joins; `ray job submit` falls back on it, raylane does not
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


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
        try:
            with open(config_file, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError) as exc:  # load_config already refused these with a clear message
            raise cfg.ConfigError(f"{config_file}: {exc}") from exc
        if not isinstance(loaded, Mapping):
            raise cfg.ConfigError(f"{config_file}: the top level must be a mapping of keys to values")
        out += _flatten(loaded)
    return out + list(overrides)


def entrypoint(job: str, overrides: Sequence[str], run_name: str | None = None, python: str = "python") -> str:
    """The shell command the cluster runs; every argument quoted, so a value is never split or expanded."""
    argv = [python, "-m", job_module(job)]
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

def resolve_address(address: str | None) -> tuple[str, str]:
    """``(url, where it came from)``: ``--address``, else $RAY_API_SERVER_ADDRESS, else the
    dev cluster recorded by ``raylane dev-cluster up``, else Ray's default http://127.0.0.1:8265."""
    if address:
        return normalize_address(address, "--address"), "--address"
    if os.environ.get(ADDRESS_ENV):
        return normalize_address(os.environ[ADDRESS_ENV], ADDRESS_ENV), ADDRESS_ENV
    from raylane import devcluster

    try:
        state = devcluster.DevClusterState.load(devcluster.default_dir())
    except devcluster.DevClusterError:
        state = None
    if state is not None:
        return state.dashboard_url, f"the dev cluster recorded in {devcluster.default_dir()}"
    return DEFAULT_ADDRESS, "the default"


def _dev_cluster_gcs(url: str) -> list[str]:
    """The GCS address of the recorded dev cluster when ``url`` is its Jobs API: the same cluster."""
    from raylane import devcluster

    try:
        state = devcluster.DevClusterState.load(devcluster.default_dir())
    except devcluster.DevClusterError:
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


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _jobs_api_env(url: str):
    """While Ray's client is built: ``$RAY_API_SERVER_ADDRESS=url``. The client lets that
    variable, else $RAY_ADDRESS, override the address it is given; this makes the override
    the URL raylane chose, so neither a shell's RAY_ADDRESS nor a stale variable reroutes it."""
    with _ENV_LOCK:
        before = os.environ.get(ADDRESS_ENV)
        os.environ[ADDRESS_ENV] = url
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ADDRESS_ENV, None)
            else:
                os.environ[ADDRESS_ENV] = before


# ------------------------------------------------------------------------------ the client

def _call(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run one blocking call with a deadline. The Ray client sets no timeout on its HTTP
    requests, so the call runs in a daemon thread that is left behind if it hangs."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            box.put((False, exc))

    threading.Thread(target=run, daemon=True, name=f"raylane-{what}").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise SubmissionError(f"{what}: no answer within {timeout_s:g} s", code=3) from None
    if ok:
        return value
    raise value


@dataclass(frozen=True)
class JobInfo:
    """One submitted job, as the Jobs API reports it."""

    submission_id: str
    status: str
    message: str
    entrypoint: str
    start_time: float | None
    end_time: float | None
    metadata: dict

    @classmethod
    def from_ray(cls, info: Any) -> "JobInfo":
        def seconds(ms: Any) -> float | None:
            return ms / 1000.0 if ms else None

        return cls(str(info.submission_id), str(info.status), info.message or "", info.entrypoint or "",
                   seconds(info.start_time), seconds(info.end_time), dict(info.metadata or {}))

    def to_json(self) -> dict:
        return dict(self.__dict__)


class JobsClient:
    """The Ray Jobs API of one cluster, with raylane's token handling and deadlines.

    >>> jobs = JobsClient("http://127.0.0.1:8265")  # doctest: +SKIP
    >>> sid = jobs.submit("linreg", ["driver.max_steps=5"])  # doctest: +SKIP
    >>> jobs.follow(sid, print)  # doctest: +SKIP
    'SUCCEEDED'
    """

    def __init__(self, address: str | None = None, *, timeout_s: float = 30.0, warn: Callable[[str], None] = lambda m: None):
        self.url, self.source = resolve_address(address)
        self.timeout_s = timeout_s
        if note := ambient_address_note(self.url, same_cluster=_dev_cluster_gcs(self.url)):
            warn(note)
        try:
            self.token = security.find_token()
        except security.SecurityError as exc:
            raise SubmissionError(str(exc)) from None
        headers = {}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token.value}"
            if self.token.path is not None and (problem := security.token_file_warning(self.token.path)):
                warn(problem)
            if problem := security.plain_http_warning(self.url, urlsplit(self.url).hostname or ""):
                warn(problem)

        def connect():
            import logging

            from ray.job_submission import JobSubmissionClient

            # Ray's client logs "WebSocket closed ..." at INFO after every tail; raylane says how the job ended instead.
            logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)

            with _jobs_api_env(self.url):
                return JobSubmissionClient(self.url, headers=headers)

        self._client = self._do(connect, "connecting to the Jobs API")

    def _do(self, fn: Callable[[], Any], what: str) -> Any:
        """Call the cluster; translate what Ray raises into one actionable sentence."""
        import requests
        from ray.exceptions import AuthenticationError

        try:
            return _call(fn, self.timeout_s, f"{what} at {self.url}")
        except SubmissionError:
            raise
        except AuthenticationError as exc:
            raise SubmissionError(self._auth_message(str(exc))) from None
        except (ConnectionError, requests.ConnectionError):
            raise SubmissionError(
                f"cannot reach the Ray Jobs API at {self.url} (from {self.source}). Is the cluster up? "
                "`raylane dev-cluster up` starts one here; for a remote cluster, forward its dashboard port "
                "(`kubectl port-forward`, an SSH tunnel) and pass --address http://127.0.0.1:PORT.") from None
        except requests.RequestException as exc:  # anything else on the wire: a reset, a bad TLS certificate
            raise SubmissionError(f"{what} at {self.url} failed: {exc}") from None
        except RuntimeError as exc:  # the client's "Request failed with status code N: ..."
            text = str(exc)
            if "404" in text and "does not exist" in text:
                raise SubmissionError(f"{text.split(': ', 1)[-1].rstrip('.')} on {self.url} (`raylane list` shows the jobs there)") from None
            raise SubmissionError(f"the Jobs API at {self.url} refused {what}: {text}") from None

    def _auth_message(self, ray_text: str) -> str:
        refused = "Authentication failed" in ray_text  # 403: a token was sent and did not match
        if self.token is None:
            head = f"the cluster at {self.url} requires an authentication token and none was found."
        elif refused:
            head = f"the cluster at {self.url} refused the token from {self.token.source}: it is not this cluster's token."
        else:
            head = f"the cluster at {self.url} asked for a token (401) although one from {self.token.source} was sent."
        return f"{head} {security.HOW_TO_SUPPLY}"

    # ---------------------------------------------------------------------------- calls

    def submit(self, job: str, overrides: Sequence[str], *, run_name: str | None = None) -> str:
        command = entrypoint(job, overrides, run_name)
        metadata = {"raylane.job": job, **({"raylane.run_name": run_name} if run_name else {})}
        # No runtime_env: the cluster's image has raylane installed (deploy/Dockerfile), and
        # the dev cluster runs this very interpreter, so there is nothing to ship.
        return self._do(lambda: self._client.submit_job(entrypoint=command, metadata=metadata), f"submitting {job}")

    def info(self, submission_id: str) -> JobInfo:
        return JobInfo.from_ray(self._do(lambda: self._client.get_job_info(submission_id), f"looking up {submission_id}"))

    def status(self, submission_id: str) -> str:
        return str(self._do(lambda: self._client.get_job_status(submission_id), f"looking up {submission_id}"))

    def logs(self, submission_id: str) -> str:
        return self._do(lambda: self._client.get_job_logs(submission_id), f"reading the logs of {submission_id}")

    def list_jobs(self) -> list[JobInfo]:
        jobs = self._do(self._client.list_jobs, "listing jobs")
        # Drivers started with ray.init on the cluster have no submission id: not submitted jobs.
        out = [JobInfo.from_ray(j) for j in jobs if getattr(j, "submission_id", None)]
        return sorted(out, key=lambda j: j.start_time or 0.0)

    def stop(self, submission_id: str, *, wait_s: float = 60.0) -> str:
        """Ask the job to stop; returns its final status, waiting up to ``wait_s`` for it."""
        self._do(lambda: self._client.stop_job(submission_id), f"stopping {submission_id}")
        deadline = time.monotonic() + wait_s
        while True:
            status = self.status(submission_id)
            if status in TERMINAL:
                return status
            if time.monotonic() > deadline:
                raise SubmissionError(f"{submission_id} was asked to stop but is still {status} after {wait_s:g} s; "
                                      f"`raylane status {submission_id}` shows when it ends", code=3)
            time.sleep(0.5)

    def follow(self, submission_id: str, out: Callable[[str], None], *, timeout_s: float | None = None,
               poll_s: float = 1.0, unreachable_s: float = 60.0) -> str:
        """Stream the job's logs to ``out`` until it ends; returns its final status.

        Logs come from Ray's log tail (a websocket), the status from polling: the tail
        alone cannot tell a finished job from a lost connection. If the tail breaks while
        the job runs, the rest is read by polling the full log; once the job has ended,
        what the tail has not delivered yet is read from the full log too. Both start at
        the log's first byte, so ``printed`` is where one continues the other.
        ``timeout_s`` bounds the whole wait; ``unreachable_s`` bounds how long the
        cluster may stop answering.
        """
        self.status(submission_id)  # an unknown id fails here, before anything is printed
        chunks: queue.Queue = queue.Queue()

        def tail() -> None:
            async def run() -> None:
                async for chunk in self._client.tail_job_logs(submission_id):
                    chunks.put(("log", chunk))

            try:
                asyncio.run(run())
                chunks.put(("end", None))
            except Exception as exc:  # reported by switching to polling, below
                chunks.put(("broken", exc))

        threading.Thread(target=tail, daemon=True, name="raylane-log-tail").start()
        printed = 0  # characters of the log shown so far: the tail starts at the log's beginning
        tail_alive = True
        status = "PENDING"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_poll = 0.0
        last_answer = time.monotonic()
        while True:
            try:
                kind, item = chunks.get(timeout=0.2)
                if kind == "log":
                    out(item)
                    printed += len(item)
                    continue  # drain what is queued before the next status poll
                tail_alive = False
            except queue.Empty:
                pass
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + poll_s
                try:
                    status = self.status(submission_id)
                    last_answer = now
                except SubmissionError as exc:
                    if now - last_answer > unreachable_s:
                        raise SubmissionError(f"lost the cluster while following {submission_id}: {exc}", code=3) from None
                if not tail_alive or status in TERMINAL:
                    # The full log: after the tail broke, or once the job has ended (its log is
                    # then complete, while Ray's tail takes ~5 s more to close). Chunks the tail
                    # still has queued are already in it.
                    text = self._poll_logs(submission_id)
                    if text is not None and len(text) > printed:
                        out(text[printed:])
                        printed = len(text)
                if status in TERMINAL:
                    return status
            if deadline is not None and now > deadline:
                raise SubmissionError(f"{submission_id} is still {status} after {timeout_s:g} s; it keeps running: "
                                      f"`raylane logs {submission_id} --follow` to watch again, `raylane stop {submission_id}` to stop it", code=3)

    def _poll_logs(self, submission_id: str) -> str | None:
        try:
            return self.logs(submission_id)
        except SubmissionError:
            return None
