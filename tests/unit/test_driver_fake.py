"""The driver's state machine against an in-process workload: no Ray needed."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from raylane.checkpoint import CheckpointStore
from raylane.cluster import ClusterView, NodeInfo
from raylane.driver import Driver, DriverConfig, DriverError, NonFiniteError, State
from raylane.placement import RoleSpec
from raylane.workload import BaseWorkload
from raylane.group import PoolError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VIEW = ClusterView((NodeInfo("head", cpus=4, available={"CPU": 4.0}),))


class Counter(BaseWorkload):
    """x <- x * 0.5 + step, so the final value depends on every step being applied once."""

    name = "counter"
    main_metric = "loss"
    guarded_metrics = ("loss",)

    def __init__(self, fail_at=(), nan_at=None, bug_at=None, target=None):
        self.x = 1.0
        self.applied: list[int] = []
        self.fail_at = set(fail_at)
        self.nan_at = nan_at
        self.bug_at = bug_at
        self.target = target
        self.recoveries = 0
        self.closed = False

    def roles(self):
        return [RoleSpec("thing", {"CPU": 1.0}, count=1, stateful=True)]

    def setup(self, ctx):
        assert ctx.plan.count("thing") == 1

    def step(self, step):
        if step in self.fail_at:
            self.fail_at.discard(step)
            raise PoolError(f"actor lost at step {step}")
        if step == self.bug_at:
            raise ValueError("a bug in the step")
        self.x = self.x * 0.5 + step
        self.applied.append(step)
        loss = float("nan") if step == self.nan_at else 1.0 / (step + 1)
        return {"loss": loss, "x": self.x}

    def state_dict(self):
        return {"x": self.x, "arr": np.array([self.x])}

    def load_state_dict(self, state):
        self.x = state["x"]
        assert state["arr"][0] == self.x

    def done(self, step, metrics):
        return self.target is not None and metrics["loss"] <= self.target

    def recover(self, ctx, error):
        self.recoveries += 1

    def close(self):
        self.closed = True


def reference(steps: int) -> float:
    x = 1.0
    for s in range(steps):
        x = x * 0.5 + s
    return x


def drive(tmp_path, workload, **conf):
    conf.setdefault("run_name", "r")
    conf.setdefault("progress", False)
    conf.setdefault("tensorboard", False)
    d = Driver(workload, DriverConfig(runs_dir=str(tmp_path), **conf), cluster_source=lambda: VIEW, poll_events=False)
    return d, d.run()


def test_runs_to_finished_and_writes_the_run_folder(tmp_path):
    w = Counter()
    d, summary = drive(tmp_path, w, max_steps=12, checkpoint_every_steps=5)
    assert d.state is State.FINISHED
    assert [s for _, s in d.history] == [State.INITIALIZING, State.RUNNING, State.FINISHED]
    assert summary["steps"] == 12 and summary["state"] == "finished"
    assert math.isclose(w.x, reference(12))
    store = CheckpointStore(str(tmp_path / "r" / "checkpoints"))
    assert store.steps() == [5, 10, 12]  # every 5 and the final step; the initial step-0 one was pruned (keep=3)
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["checkpoints_written"] == 4 and saved["final_metrics"]["x"] == pytest.approx(reference(12))
    assert w.closed


def test_workload_target_stops_early(tmp_path):
    d, summary = drive(tmp_path, Counter(target=0.2), max_steps=100)
    assert summary["steps"] == 5  # loss 1/(s+1) <= 0.2 first after step index 4


def test_recoverable_failure_reloads_the_last_checkpoint(tmp_path):
    w = Counter(fail_at={7})
    d, summary = drive(tmp_path, w, max_steps=10, checkpoint_every_steps=5)
    assert w.recoveries == 1
    states = [s for _, s in d.history]
    assert states.count(State.RECOVERING) == 1 and states[-1] is State.FINISHED
    # steps 5 and 6 ran before the failure, were rolled back to checkpoint 5 and ran again
    assert w.applied == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]
    assert math.isclose(w.x, reference(10))
    assert summary["failures_recovered"] == 1


def test_failures_past_the_budget_fail_with_grouped_errors(tmp_path):
    w = Counter(fail_at={2, 3, 4})
    with pytest.raises(DriverError) as info:
        drive(tmp_path, w, max_steps=10, checkpoint_every_steps=1, max_failures=2)
    msg = str(info.value)
    assert "3 failures exceed max_failures=2" in msg and "actor lost at step 4" in msg
    assert "last good checkpoint is step 4" in msg
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["state"] == "failed"


def test_a_bug_fails_at_once_without_retry(tmp_path):
    w = Counter(bug_at=3)
    with pytest.raises(DriverError, match="not recoverable: ValueError: a bug in the step"):
        drive(tmp_path, w, max_steps=10, max_failures=5)
    assert w.recoveries == 0


def test_nan_loss_stops_and_never_checkpoints_nan(tmp_path):
    w = Counter(nan_at=6)
    with pytest.raises(NonFiniteError) as info:
        drive(tmp_path, w, max_steps=20, checkpoint_every_steps=1)
    msg = str(info.value)
    assert "metric 'loss' is nan at step 7" in msg and "last good checkpoint is step 6" in msg
    step, state = CheckpointStore(str(tmp_path / "r" / "checkpoints")).load()
    assert step == 6 and math.isfinite(state["workload"]["x"]) and state["workload"]["x"] == pytest.approx(reference(6))


def test_same_run_name_resumes_from_latest_checkpoint(tmp_path):
    first = Counter()
    drive(tmp_path, first, max_steps=8, checkpoint_every_steps=4)
    second = Counter()
    d, summary = drive(tmp_path, second, max_steps=15, checkpoint_every_steps=4)
    assert summary["resumed_from"] == 8
    assert second.applied == list(range(8, 15))
    assert math.isclose(second.x, reference(15))


def test_resume_off_refuses_a_run_that_has_checkpoints(tmp_path):
    drive(tmp_path, Counter(), max_steps=8, checkpoint_every_steps=4)
    again = Counter()
    with pytest.raises(DriverError, match=r"run 'r' already has checkpoints \(steps \[0, 4, 8\]\).*driver.resume=true.*another run name"):
        drive(tmp_path, again, max_steps=3, resume=False)
    assert again.applied == []  # nothing ran, nothing mixed with the old run's checkpoints


def test_resume_off_on_a_new_name_starts_fresh(tmp_path):
    w = Counter()
    d, summary = drive(tmp_path, w, max_steps=3, resume=False, checkpoint_every_steps=0)
    assert summary["resumed_from"] is None and w.applied == [0, 1, 2]
    # the initial checkpoint is written even with periodic checkpoints off
    assert CheckpointStore(str(tmp_path / "r" / "checkpoints")).steps() == [0, 3]


def test_a_failure_while_recovering_counts_against_the_budget(tmp_path):
    class FlakyRecover(Counter):
        def recover(self, ctx, error):
            self.recoveries += 1
            if self.recoveries == 1:
                raise PoolError("replacement died while starting")

    w = FlakyRecover(fail_at={4})
    d, summary = drive(tmp_path, w, max_steps=8, checkpoint_every_steps=2, max_failures=3)
    assert w.recoveries == 2 and summary["failures_recovered"] == 1 and summary["state"] == "finished"
    assert math.isclose(w.x, reference(8))
    with pytest.raises(DriverError, match="2 failures exceed max_failures=1"):
        drive(tmp_path, FlakyRecover(fail_at={4}), max_steps=8, checkpoint_every_steps=2, max_failures=1, run_name="r2")


def test_errors_between_steps_go_through_the_failure_policy(tmp_path):
    class BadSave(Counter):
        saves = 0

        def state_dict(self):
            BadSave.saves += 1
            if BadSave.saves == 3:
                raise PoolError("learner lost while saving")
            return super().state_dict()

    w = BadSave()
    d, summary = drive(tmp_path, w, max_steps=6, checkpoint_every_steps=2)
    assert summary["state"] == "finished" and summary["failures_recovered"] == 1
    assert math.isclose(w.x, reference(6))


def test_unplaceable_role_fails_in_initializing(tmp_path):
    class Big(Counter):
        def roles(self):
            return [RoleSpec("huge", {"CPU": 64.0}, count=1)]

    with pytest.raises(DriverError, match="role 'huge' needs 1 actor"):
        drive(tmp_path, Big(), max_steps=3)


def test_tensorboard_scalars_are_written(tmp_path):
    drive(tmp_path, Counter(), max_steps=3, tensorboard=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((tmp_path / "r" / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert acc.Scalars("x")[-1].value == pytest.approx(reference(3))


class FakePool:
    """Stands in for a pool (membership) in the driver's event handling: where its actors are."""

    def __init__(self, role, nodes):
        self.role, self._nodes, self.target, self.size = role, nodes, 1, 1
        self.evacuated, self.start_timeout_s = [], 1.0

    def status(self):
        return type("S", (), {"nodes": self._nodes, "evictions": ()})()

    def evacuate(self, node_id, reason):
        self.evacuated.append((node_id, reason))

    def wait_ready(self, timeout_s):
        pass

    def shutdown(self):
        pass


class ScriptedEvents:
    """Node events delivered at chosen steps, as the preemption monitor would."""

    def __init__(self, at_step, events, workload, later=None):
        self.script = {at_step: events, **(later or {})}
        self.workload = workload

    def poll(self):
        return self.script.pop(self.workload.applied[-1], []) if self.workload.applied else []


def test_preemption_notice_for_a_stateful_node_checkpoints_at_once(tmp_path):
    from raylane.preemption import NodeLeaving

    class WithPools(Counter):
        def __init__(self):
            super().__init__()
            self.stateful = FakePool(RoleSpec("thing", {"CPU": 1.0}, count=1, stateful=True), {"od-node": 1})
            self.stateless = FakePool(RoleSpec("worker", {"CPU": 1.0}, count=1), {"spot-node": 1})

        def roles(self):
            return [self.stateful.role, self.stateless.role]

        def setup(self, ctx):  # pools the test built itself, handed to the driver's registry
            ctx.groups.adopt(self.stateful)
            ctx.groups.adopt(self.stateless)

    from raylane.preemption import NodeLost

    w = WithPools()
    events = ScriptedEvents(6, [NodeLeaving("od-node", "on-demand", None), NodeLeaving("spot-node", "spot", time.time() + 30.0)], w,
                            later={9: [NodeLost("od-node", "on-demand")]})
    d = Driver(w, DriverConfig(runs_dir=str(tmp_path), run_name="r", max_steps=14, checkpoint_every_steps=5, progress=False, tensorboard=False),
               cluster_source=lambda: VIEW, event_source=events)
    d.run()
    rows = [json.loads(l) for l in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    ckpts = [(e["step"], e["reason"]) for e in rows if e["event"] == "checkpoint"]
    assert (7, "preemption notice for a node with stateful actors") in ckpts  # step 6 ran as the 7th step
    # While the stateful actor stays on the leaving node, every step is checkpointed (its
    # loss then costs only the step under way); once the node is gone, the usual interval.
    assert [s for s, _ in ckpts] == [0, 5, 7, 8, 9, 10, 14]
    assert w.stateless.evacuated == [("spot-node", "preemption notice")]  # stateless actors move early
    assert w.stateful.evacuated == [("od-node", "node lost")]  # stateful ones stay until lost, then are replaced


def test_sigterm_stops_at_the_next_step_with_a_checkpoint_and_a_resume_continues(tmp_path):
    import os
    import signal

    class Stopped(Counter):
        def step(self, step):
            if step == 6:
                os.kill(os.getpid(), signal.SIGTERM)  # what `raylane stop` / `ray job stop` send
            return super().step(step)

    w = Stopped()
    before = signal.getsignal(signal.SIGTERM)
    d, summary = drive(tmp_path, w, max_steps=20, checkpoint_every_steps=0)
    assert d.state is State.STOPPED and summary["state"] == "stopped" and summary["error"] is None
    assert summary["steps"] == 7 and w.applied == list(range(7))  # the step under way completed
    assert CheckpointStore(str(tmp_path / "r" / "checkpoints")).latest().step == 7
    assert signal.getsignal(signal.SIGTERM) == before  # the driver's handler is gone with the run
    w2 = Counter()
    d2, summary2 = drive(tmp_path, w2, max_steps=20)
    assert summary2["resumed_from"] == 7 and math.isclose(w2.x, reference(20))
