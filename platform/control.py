"""The control channel of a running job: how ``raylane pools`` and ``raylane scale`` reach
its driver.

The channel is Ray's GCS key-value store (namespace ``raylane``), not a named actor:

- it costs no process and no CPU reservation (a named actor would hold a worker on a
  2-core head for the whole run), and it cannot be lost with a node: the GCS lives on
  the head, like the cluster itself;
- the driver only acts between steps anyway (a resize mid-step would tear a batch), so
  a request can sit in the store until the next step boundary; a named actor would
  have to queue it just the same;
- any client that can join the cluster (the CLI, a notebook, a script) can read and
  write it, with Ray's own token authentication in front of it.

Keys, under ``run/<run name>/``: ``info`` (job, pid, state, heartbeat), ``pools`` (the
latest status of every pool, rewritten at every step boundary), ``req/<id>`` (a request
a client wrote; the driver deletes it when it takes it) and ``resp/<id>`` (the driver's
answer). Values are JSON.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raylane import raystate

PREFIX = "run/"


class ControlError(RuntimeError):
    """A request the channel cannot serve; the message says what to change."""


def _key(run: str, *parts: str) -> str:
    return PREFIX + "/".join((run,) + parts)


# ----------------------------------------------------------------------------- pure checks


@dataclass(frozen=True)
class PoolReport:
    """What ``raylane pools`` shows for one pool (JSON in the store)."""

    role: str
    target: int
    wanted: int
    live: int
    starting: int
    lo: int
    hi: int
    nodes: dict[str, int]
    markets: dict[str, int]
    busy_fraction: float
    evictions: list[dict]
    placement_error: str | None
    autoscale: dict | None = None


def check_scale(pools: dict[str, dict], role: str, n: int) -> None:
    """Raise :class:`ControlError` when ``scale role n`` cannot be asked of these pools."""
    if role not in pools:
        raise ControlError(f"unknown role {role!r}; this run's pools are: {', '.join(sorted(pools)) or 'none'}")
    p = pools[role]
    if p["lo"] == p["hi"]:
        raise ControlError(f"role {role!r} has a fixed size of {p['lo']} (part of the job's maths); only elastic pools scale")
    if not p["lo"] <= n <= p["hi"]:
        raise ControlError(f"{n} actors for role {role!r} is outside its range {p['lo']}..{p['hi']}; choose N in that range "
                           f"(the job's config sets the maximum)")


# ----------------------------------------------------------------------------- driver side


def runs_home() -> Path:
    """Where drivers on this machine leave their runs' addresses (``$RAYLANE_HOME/runs``)."""
    return Path(os.environ.get("RAYLANE_HOME", Path.home() / ".raylane")) / "runs"


def _local_file(run: str) -> Path:
    return runs_home() / f"{run}.json"


def local_address(run: str) -> str | None:
    """The Ray address of ``run`` when its driver runs on this machine and is alive.

    An embedded Ray (``raylane run`` without ``--address``) is not one that
    ``address="auto"`` finds, so the driver leaves its address here for the CLI."""
    try:
        rec = json.loads(_local_file(run).read_text())
        os.kill(int(rec["pid"]), 0)
        return str(rec["address"])
    except (OSError, ValueError, KeyError):
        return None


class ControlChannel:
    """The driver's end: registers the run, publishes pool reports, takes requests."""

    def __init__(self, run: str, job: str):
        self.run = run
        self.job = job
        self.started = time.time()

    def register(self) -> None:
        self._info("running")
        path = _local_file(self.run)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run": self.run, "address": raystate.gcs_address(), "pid": os.getpid()}))

    def _info(self, state: str) -> None:
        raystate.kv_put(_key(self.run, "info"), {
            "run": self.run, "job": self.job, "state": state, "pid": os.getpid(), "host": socket.gethostname(),
            "started": self.started, "heartbeat": time.time(),
        })

    def publish(self, step: int, reports: list[PoolReport]) -> None:
        raystate.kv_put(_key(self.run, "pools"), {"time": time.time(), "step": step, "pools": {r.role: asdict(r) for r in reports}})
        self._info("running")

    def requests(self) -> list[dict]:
        """Pending requests, oldest first; each is taken (deleted) as it is read."""
        out = []
        for key in raystate.kv_keys(_key(self.run, "req", "")):
            req = raystate.kv_get(key)
            raystate.kv_del(key)
            if isinstance(req, dict) and "id" in req:
                out.append(req)
        return sorted(out, key=lambda r: r.get("time", 0.0))

    def respond(self, req: dict, ok: bool, message: str, **extra: Any) -> None:
        raystate.kv_put(_key(self.run, "resp", req["id"]), {"id": req["id"], "ok": ok, "message": message, "time": time.time(), **extra})

    def close(self, state: str) -> None:
        _local_file(self.run).unlink(missing_ok=True)
        raystate.kv_del(_key(self.run, "pools"))
        self._info(state)


# ----------------------------------------------------------------------------- client side


class ControlClient:
    """The CLI's end. Needs a connected Ray (``ray.init(address=...)``)."""

    def runs(self) -> dict[str, dict]:
        out = {}
        for key in raystate.kv_keys(PREFIX):
            if key.endswith("/info"):
                info = raystate.kv_get(key)
                if isinstance(info, dict):
                    out[info["run"]] = info
        return dict(sorted(out.items()))

    def pools(self, run: str) -> dict:
        info = raystate.kv_get(_key(run, "info"))
        if info is None:
            running = [r for r, i in self.runs().items() if i.get("state") == "running"]
            raise ControlError(f"unknown run {run!r} on this cluster; running: {', '.join(running) or 'none'}")
        if info.get("state") != "running":
            raise ControlError(f"run {run!r} is {info.get('state')}; only a running job has pools")
        report = raystate.kv_get(_key(run, "pools"))
        if report is None:
            raise ControlError(f"run {run!r} has not reported its pools yet (it is starting); try again in a few seconds")
        return report

    def request(self, run: str, op: str, **fields: Any) -> str:
        rid = uuid.uuid4().hex[:12]
        raystate.kv_put(_key(run, "req", rid), {"id": rid, "op": op, "time": time.time(), **fields})
        return rid

    def response(self, run: str, rid: str) -> dict | None:
        return raystate.kv_get(_key(run, "resp", rid))

    def scale(self, run: str, role: str, n: int, *, timeout_s: float, poll_s: float = 0.5, on_update=None) -> dict:
        """Ask the driver of ``run`` to resize ``role`` to ``n``; wait until ``n`` are live.

        Returns the final report of the pool. Raises :class:`ControlError` for a bad
        request, when the driver refuses it, or when the pool cannot reach ``n`` (the
        message names the missing resources) or does not within ``timeout_s``.
        """
        report = self.pools(run)
        check_scale(report["pools"], role, n)
        rid = self.request(run, "scale", role=role, n=n)
        deadline = time.monotonic() + timeout_s
        answer, pool = None, None
        while time.monotonic() < deadline:
            if answer is None:
                answer = self.response(run, rid)
                if answer is not None:
                    if not answer["ok"] or (answer.get("missing") and not answer.get("autoscaler")):
                        raise ControlError(answer["message"])
                    if on_update:
                        on_update(answer["message"])
            report = self.pools(run)
            pool = report["pools"].get(role)
            if answer is not None and pool is not None and pool["live"] == n and pool["target"] == n and answer.get("step", -1) <= report["step"]:
                return pool
            time.sleep(poll_s)
        state = "no answer from the driver (it acts between steps; is a step very long?)" if answer is None else f"{pool['live'] if pool else '?'} are live"
        raise ControlError(f"{role!r} did not reach {n} actors within {timeout_s:g} s: {state}")
