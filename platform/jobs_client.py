"""The Ray Jobs API of one cluster, with raylane's token handling and a deadline on every call.

:class:`JobsClient` wraps Ray's ``JobSubmissionClient``. The address comes from
:func:`raylane.submission.resolve_address`, never from Ray: the client is built with
$RAY_API_SERVER_ADDRESS set to that URL (:func:`_jobs_api_env`), since Ray's client lets
that variable, else $RAY_ADDRESS, override the address it is given.

Every call to the cluster has a deadline (:func:`_call`), including the connection
check the Ray client makes when it is created, and every error reaches the user as a
:class:`~raylane.submission.SubmissionError` with one sentence on what to do: a missing
or refused token, an address nothing listens on, an unknown submission id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from raylane import security
from raylane.submission import ADDRESS_ENV, SubmissionError, ambient_address_note, dev_cluster_gcs, entrypoint, resolve_address, shipped

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


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
        if note := ambient_address_note(self.url, same_cluster=dev_cluster_gcs(self.url)):
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

    def submit(self, job: str, overrides: Sequence[str], *, run_name: str | None = None, name: str | None = None) -> str:
        """Submit ``job`` (a registered name, or a user's ``path/to/file.py:NAME`` or
        ``package.module:NAME``, whose folder is shipped); ``name`` is the job's own name
        for the metadata. Returns the submission id."""
        runtime_env = None
        if ":" in job:
            job, folders = shipped(job)
            runtime_env = {"py_modules": folders}
        # Otherwise no runtime_env: the cluster's image has raylane installed (deploy/Dockerfile),
        # and the dev cluster runs this very interpreter, so there is nothing to ship.
        command = entrypoint(job, overrides, run_name)
        metadata = {"raylane.job": name or job, **({"raylane.run_name": run_name} if run_name else {})}
        return self._do(lambda: self._client.submit_job(entrypoint=command, metadata=metadata, runtime_env=runtime_env), f"submitting {name or job}")

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
