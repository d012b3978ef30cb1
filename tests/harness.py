"""Running a workload under the real Driver with faults injected at chosen steps.

Tests import it by name (tests/ is on sys.path through tests/conftest.py)::

    from harness import drive  # tests/harness.py

    run = drive(workload, conf.driver, at={4: kill_a_sampler})
    run = drive(workload, conf.driver, during=lambda steps: (steps.wait(6), kill_the_trainer()))
    assert run.summary["state"] == "finished"
    failure = next(e for e in run.events if e["event"] == "failure")

The Driver always runs in the calling thread: it installs its signal handlers there, and a
test that sends the process a signal needs that thread to be the main one. Actions run
either through the driver's ``before_step`` callback (``at``: synchronous, exactly before a
given step, as part of it) or in a background thread (``during``: a schedule that follows
the step count).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
import torch

from raylane.checkpoint import read_part
from raylane.checkpoint_format import StoredPart
from raylane.driver import Driver, DriverConfig, State
from raylane.runlog import read_jsonl


class RunOver(Exception):
    """Raised in a ``during`` schedule that waits for a step the run never reached."""


class Steps(list):
    """The step indices the workload was asked to run, in call order, replays after a
    recovery included; an index is appended as its call begins (before any action)."""

    def __init__(self) -> None:
        super().__init__()
        self.run_over = threading.Event()  # the driver has returned (or raised)
        self.schedule_over = threading.Event()  # ``during`` has returned (or raised)

    def wait(self, n: int, poll_s: float = 0.02) -> None:
        """Block until ``n`` step calls have begun; RunOver if the run ends first."""
        while len(self) < n:
            if self.run_over.is_set():
                raise RunOver(f"the run ended after {len(self)} step calls; the schedule waited for {n}")
            time.sleep(poll_s)

    def rollback(self) -> tuple[int, int]:
        """``(last, next)``: the last index called before the first rollback and the index the
        run went on with (the checkpoint's step).

        A failure the driver records at step ``F`` (``steps_done``) was raised either by the
        call of index ``F`` or at the boundary after index ``F - 1`` (a snapshot or checkpoint
        of that step), so ``last`` is ``F`` or ``F - 1``."""
        for j in range(1, len(self)):
            if self[j] <= self[j - 1]:
                return self[j - 1], self[j]
        raise AssertionError(f"no step was run again: {list(self)}")


@dataclass
class Driven:
    """What :func:`drive` returns."""

    summary: dict[str, Any]
    run_dir: Path
    steps: Steps
    events: list[dict] = field(default_factory=list)

    @property
    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")


def drive(
    workload: Any,
    driver: DriverConfig | Driver,
    *,
    at: dict[int, Callable[[], Any]] | None = None,
    during: Callable[[Steps], Any] | None = None,
    pace_s: float = 0.0,
    hold: bool = False,
    before_close: Callable[[], Any] | None = None,
    join_s: float = 120.0,
    steps: Steps | None = None,
    before_step: Callable[[int], Any] | None = None,
) -> Driven:
    """Run ``workload`` to its end under the Driver, in the calling thread, and return its
    summary, step log and ``events.jsonl``.

    ``driver`` is a DriverConfig (a Driver is made for it) or a Driver already made for
    ``workload``.

    ``at``: ``{i: fn}``: ``fn()`` is called once, as step ``i`` is run for the first time,
    just before the workload's own step (a failure it raises is the step's).

    ``during``: ``fn(steps)`` runs in a daemon thread started before the driver, with the
    :class:`Steps` log (``steps.wait(n)`` blocks until ``n`` step calls have begun). It is
    joined after the run (at most ``join_s``); whatever it raised is raised here, after the
    run, a wait for a step the run never reached included (RunOver).

    ``pace_s``: every step call sleeps this long first (after it is logged and its ``at``
    action ran), so a schedule lands between and inside steps as it would on real data.

    ``hold``: the workload's ``done`` is False until ``during`` is over, so the run lasts
    through the whole schedule.

    ``before_close``: called after the last step, before the run is finished (its actors still up).

    ``steps``: the :class:`Steps` log to fill, for a test whose ``before_step`` needs it,
    e.g. its ``schedule_over`` event; a new one by default.

    ``before_step(i)``: the test's own callback, after the index is logged and the ``at``
    action and pacing ran.
    """
    if hold and during is None:
        raise ValueError("hold=True needs a during schedule to wait for")
    steps = Steps() if steps is None else steps
    pending = dict(at or {})
    original_done = workload.done

    def step(i: int):
        steps.append(i)
        action = pending.pop(i, None)
        if action is not None:
            action()
        if pace_s:
            time.sleep(pace_s)
        if before_step is not None:
            before_step(i)

    if hold:
        workload.done = lambda i, m: original_done(i, m) and steps.schedule_over.is_set()
    d = driver if isinstance(driver, Driver) else Driver(workload, driver)
    d.before_step = step
    errors: list[BaseException] = []
    thread = None
    if during is not None:

        def play() -> None:
            try:
                during(steps)
            except BaseException as e:  # noqa: BLE001 - raised in the calling thread after the run
                errors.append(e)
            finally:
                steps.schedule_over.set()

        thread = threading.Thread(target=play, name="drive-schedule", daemon=True)
        thread.start()

    try:
        try:
            d.start()
            while d.step().state is State.RUNNING:
                pass
        except BaseException:  # noqa: BLE001 - the driver keeps it; finish() raises it after the summary
            pass
        if before_close is not None and d.log is not None:
            before_close()
        summary = d.finish()
    finally:
        steps.run_over.set()
        if thread is not None:
            thread.join(timeout=join_s)
    if thread is not None and thread.is_alive():
        raise AssertionError(f"the during schedule was still running {join_s} s after the run ended ({summary.get('state')})")
    if errors:
        raise AssertionError(f"the during schedule failed (run {summary.get('state')} after {len(steps)} step calls)") from errors[0]
    return Driven(summary=summary, run_dir=d.run_dir, steps=steps, events=read_jsonl(d.run_dir / "events.jsonl"))


def gone(actor: Any, timeout_s: float = 30.0, method: str = "__ray_ready__") -> None:
    """Wait until ``actor`` answers no more (its ``method`` raises RayActorError): a kill is
    asynchronous, and a call made right after it may still be served."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(getattr(actor, method).remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the actor still answers {timeout_s:g} s after it was killed")


def ranks_now(run_dir: Path | str, kind: str, key: str) -> dict[int, Any]:
    """{rank: value} from ``key`` of every ``kind`` event written so far (later events win),
    for a test that acts on a gang's actor while the run goes on, e.g.
    ``ranks_now(run_dir, "xgboost_group", "pids")[1]``: the pid of shard 1's trainer."""
    out: dict[int, Any] = {}
    path = Path(run_dir) / "events.jsonl"
    for e in read_jsonl(path) if path.exists() else []:
        if e["event"] == kind:
            out.update({int(r): v for r, v in e.get(key, {}).items()})
    return out


@contextlib.contextmanager
def ray_in_folder(folder: Path | str, num_cpus: int):
    """A local Ray started from ``folder``, as a user starts raylane from their project: the
    driver's working folder is on every worker's import path (and on this process's), so
    the project's own modules import everywhere. Restores the folder and path after."""
    import ray

    before = os.getcwd()
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield Path(folder)
    finally:
        ray.shutdown()
        os.chdir(before)
        sys.path.remove(str(folder))


def watch_restores(workload) -> list[bool]:
    """After each load_state_dict (a recovery's reload of the checkpoint), whether the
    learner now holds exactly the checkpoint's weights, version and optimizer state."""
    held: list[bool] = []
    original = workload.load_state_dict

    def load_state_dict(state):
        original(state)
        now, want = workload._learner_call("state"), state["learner"]
        if isinstance(want, StoredPart):  # the learner's own part in the store
            want = read_part(want)
        elif isinstance(want, ray.ObjectRef):  # a replica from memory
            want = ray.get(want, timeout=60)
        held.append(now["version"] == want["version"] and now["optimizer"] == want["optimizer"]
                    and now["params"].keys() == want["params"].keys()
                    and all(torch.equal(torch.as_tensor(now["params"][k]), torch.as_tensor(want["params"][k])) for k in want["params"]))

    workload.load_state_dict = load_state_dict
    return held

