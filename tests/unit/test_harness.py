"""tests/harness.py against the in-process Counter workload: no Ray."""

from __future__ import annotations

import os
import signal

import pytest

from raylane.driver import Driver, DriverConfig

from harness import RunOver, drive  # tests/harness.py
from test_driver_fake import VIEW, Counter, reference  # tests/unit/test_driver_fake.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def fake(tmp_path, workload, **conf) -> Driver:
    conf = {"run_name": "r", "progress": False, "tensorboard": False, **conf}
    return Driver(workload, DriverConfig(runs_dir=str(tmp_path), **conf), cluster_source=lambda: VIEW, poll_events=False)


def test_an_action_runs_once_before_its_step_and_replays_are_logged(tmp_path):
    w = Counter(fail_at={7})
    calls: list[list[int]] = []
    run = drive(w, fake(tmp_path, w, max_steps=10, checkpoint_every_steps=5),
                at={3: lambda: calls.append(list(w.applied)), 6: lambda: calls.append(list(w.applied))})
    assert calls == [[0, 1, 2], [0, 1, 2, 3, 4, 5]]  # before the step's own work, and only the first time
    assert run.summary["state"] == "finished" and run.summary["failures_recovered"] == 1
    assert run.steps == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9]  # step 7 failed: back to the checkpoint at 5
    assert w.x == reference(10) and w.closed
    assert any(e["event"] == "failure" for e in run.events)
    assert [r["step"] for r in run.metrics][-1] == 10


def test_a_schedule_follows_the_step_count_and_hold_keeps_the_run_going(tmp_path):
    w = Counter(target=1.0)  # done after the first step, unless held
    seen: list[int] = []

    def schedule(steps):
        steps.wait(4)
        seen.append(len(steps))

    run = drive(w, fake(tmp_path, w, max_steps=50), during=schedule, hold=True)
    assert seen and seen[0] >= 4 and run.steps.schedule_over.is_set()
    assert run.summary["state"] == "finished" and run.summary["steps"] == len(run.steps) >= 4


def test_a_schedule_waiting_for_a_step_that_never_comes_fails_the_test(tmp_path):
    w = Counter()
    with pytest.raises(AssertionError, match="the during schedule failed") as info:
        drive(w, fake(tmp_path, w, max_steps=3), during=lambda steps: steps.wait(10))
    assert isinstance(info.value.__cause__, RunOver)


def test_a_signal_sent_at_a_step_reaches_the_driver_in_the_calling_thread(tmp_path):
    w = Counter()
    run = drive(w, fake(tmp_path, w, max_steps=20, checkpoint_every_steps=0), at={6: lambda: os.kill(os.getpid(), signal.SIGTERM)})
    assert run.summary["state"] == "stopped" and run.summary["steps"] == 7 and w.applied == list(range(7))


def test_before_close_runs_with_the_workload_still_open(tmp_path):
    w = Counter()
    open_at_close: list[bool] = []
    drive(w, fake(tmp_path, w, max_steps=2), before_close=lambda: open_at_close.append(not w.closed))
    assert open_at_close == [True] and w.closed
