"""The best evaluation kept apart (driver.keep_best) and early stopping (driver.early_stop_*):
the pure rule, then the driver against an in-process workload (no Ray needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raylane import config as cfg
from raylane import prepare, registry
from raylane.best import Best, Rule, metric_mode, rule_for
from raylane.checkpoint import CheckpointStore
from raylane.cluster import ClusterView, NodeInfo
from raylane.driver import Driver, DriverConfig, DriverError, State
from raylane.group import PoolError
from raylane.launch import summary_line
from raylane.placement import RoleSpec
from raylane.workload import BaseWorkload

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VIEW = ClusterView((NodeInfo("head", cpus=4, available={"CPU": 4.0}),))
# Held-out accuracy by step (1-based): rises to a peak at step 6, then the model overfits.
CURVE = {1: 0.60, 2: 0.70, 3: 0.74, 4: 0.76, 5: 0.765, 6: 0.78, 7: 0.775, 8: 0.77, 9: 0.772, 10: 0.76, 11: 0.75, 12: 0.74}


class Overfits(BaseWorkload):
    """Weights that change every step and a held-out accuracy that peaks, reported every
    ``eval_every`` steps; fails once at each step in ``fail_at``."""

    name = "overfits"
    main_metric = "val_acc"
    metrics = ("val_acc", "loss", "clock")

    def __init__(self, eval_every: int = 1, fail_at=()):
        self.w = np.zeros(3)
        self.eval_every, self.fail_at = eval_every, set(fail_at)

    def roles(self):
        return [RoleSpec("thing", {"CPU": 1.0}, count=1, stateful=True)]

    def setup(self, ctx):
        pass

    def step(self, step):
        if step in self.fail_at:
            self.fail_at.discard(step)
            raise PoolError(f"actor lost at step {step}")
        self.w = self.w + (step + 1)
        out = {"loss": 1.0 / (step + 1), "clock": step}
        if (step + 1) % self.eval_every == 0:
            out["val_acc"] = CURVE[step + 1]
        return out

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = np.array(state["w"])


def drive(tmp_path, workload, **conf):
    conf.setdefault("run_name", "r")
    conf.setdefault("progress", False)
    conf.setdefault("tensorboard", False)
    d = Driver(workload, DriverConfig(runs_dir=str(tmp_path), **conf), cluster_source=lambda: VIEW, poll_events=False)
    return d, d.run()


def weights_after(steps: int) -> np.ndarray:
    return np.full(3, float(sum(range(1, steps + 1))))


def events(tmp_path, kind):
    rows = [json.loads(line) for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind]


# -- the rule, pure ------------------------------------------------------------------------

@pytest.mark.parametrize("metric,mode", [("valid-auc", "max"), ("val_acc", "max"), ("return_mean", "max"),
                                         ("valid-logloss", "min"), ("loss", "min"), ("clock", None)])
def test_mode_from_the_metric_name(metric, mode):
    assert metric_mode(metric) == mode


def test_the_rule_is_off_unless_asked_and_refuses_what_the_job_does_not_report():
    w = Overfits()
    assert rule_for(DriverConfig(), w) is None
    r = rule_for(DriverConfig(keep_best=True), w)
    assert (r.metric, r.mode, r.keep, r.patience) == ("val_acc", "max", True, 0)
    with pytest.raises(ValueError, match=r"driver.best_metric='auc': job 'overfits' does not report it; it reports val_acc, loss, clock"):
        rule_for(DriverConfig(early_stop_patience=2, best_metric="auc"), w)
    with pytest.raises(ValueError, match=r"driver.best_metric='clock': its name does not say whether higher is better; set driver.best_mode=max or min"):
        rule_for(DriverConfig(keep_best=True, best_metric="clock"), w)
    assert rule_for(DriverConfig(keep_best=True, best_metric="clock", best_mode="min"), w).mode == "min"


def test_patience_counts_evaluations_without_an_improvement_by_more_than_min_delta():
    best = Best(Rule("val_acc", "max", min_delta=0.01, patience=3))
    seen = [best.see(s, {"val_acc": CURVE[s]}) for s in range(1, 13)]
    # Every new best is one to keep; patience counts from 0.76 over 0.765 (within 0.01), then from 0.78 (0.02 above 0.76)
    assert [v.improved for v in seen[:7]] == [True, True, True, True, True, True, False]
    stop = next(i + 1 for i, v in enumerate(seen) if v.stop)
    assert stop == 9 and (best.value, best.step) == (0.78, 6)
    assert "val_acc did not improve by more than 0.01 in 3 evaluations (driver.early_stop_patience=3); best 0.78 at step 6" in seen[8].stop
    assert best.see(13, {"val_acc": np.float32(0.9)}).improved and best.step == 13  # numpy numbers are numbers


def test_steps_without_a_finite_value_are_not_evaluations_and_the_state_round_trips():
    best = Best(Rule("val_acc", "max", patience=2))
    assert not best.see(1, {"loss": 0.5}).evaluated
    assert not best.see(2, {"val_acc": float("nan")}).evaluated
    assert best.see(3, {"val_acc": 0.5}).improved
    best.see(4, {"val_acc": 0.4})
    again = Best(best.rule)
    again.load(best.state())
    assert again.state() == best.state() and again.see(5, {"val_acc": 0.3}).stop
    other = Best(Rule("loss", "min"))
    other.load(best.state())  # written under another rule: the count starts over
    assert (other.value, other.since, other.evaluations) == (None, 0, 0)


# -- the driver ----------------------------------------------------------------------------

def test_keep_best_keeps_the_peak_apart_from_the_rotation(tmp_path, capsys):
    d, summary = drive(tmp_path, Overfits(), max_steps=12, checkpoint_every_steps=4, keep_checkpoints=2, keep_best=True)
    assert d.state is State.FINISHED
    main = CheckpointStore(str(tmp_path / "r" / "checkpoints"))
    assert main.steps() == [8, 12]  # the rotation kept the newest two
    best = CheckpointStore(str(tmp_path / "r" / "checkpoints" / "best"))
    assert best.steps() == [6]  # every improvement was copied; only the last copy is left
    step, state = best.load()
    assert step == 6 and np.array_equal(state["workload"]["w"], weights_after(6))
    record = json.loads((tmp_path / "r" / "checkpoints" / "best" / "BEST.json").read_text())
    assert (record["metric"], record["mode"], record["value"], record["step"]) == ("val_acc", "max", 0.78, 6)
    assert summary["best"]["kept"] == {"step": 6, "value": 0.78, "path": record["path"]}
    assert [e["step"] for e in events(tmp_path, "best_kept")] == [1, 2, 3, 4, 5, 6]
    assert "best val_acc=0.78 at step 6, kept in" in summary_line("overfits", summary)


def test_early_stop_ends_the_run_finished_with_the_reason(tmp_path):
    d, summary = drive(tmp_path, Overfits(eval_every=2), max_steps=12, checkpoint_every_steps=0, early_stop_patience=2)
    # evaluations at steps 2, 4, 6 (best), 8, 10: two without an improvement after step 6
    assert d.state is State.FINISHED and summary["steps"] == 10
    assert summary["end_reason"].startswith("early stop: val_acc did not improve in 2 evaluations") and "best 0.78 at step 6" in summary["end_reason"]
    assert summary["best"]["step"] == 6 and "kept" not in summary["best"]
    assert "(early stop: val_acc" in summary_line("overfits", summary)
    assert not (tmp_path / "r" / "checkpoints" / "best").exists()  # keep_best off: nothing kept


def test_a_rollback_stops_at_the_same_step_as_a_run_without_it(tmp_path):
    """The patience count travels with the checkpoint: a failure after the best was seen rolls
    it back too, so the run stops where a run without the failure stops, with the same best kept."""
    kw = dict(max_steps=12, checkpoint_every_steps=3, early_stop_patience=3, keep_best=True)
    _, clean = drive(tmp_path / "a", Overfits(), **kw)
    w = Overfits(fail_at={7})
    d, failed = drive(tmp_path / "b", w, **kw)
    assert failed["failures_recovered"] == 1
    assert failed["steps"] == clean["steps"] == 9
    assert failed["best"]["kept"]["step"] == clean["best"]["kept"]["step"] == 6
    assert np.array_equal(w.w, weights_after(9))


def test_a_resumed_run_counts_on_and_keeps_the_best_it_had(tmp_path):
    drive(tmp_path, Overfits(), max_steps=7, checkpoint_every_steps=7, keep_best=True, early_stop_patience=3)
    d, summary = drive(tmp_path, Overfits(), max_steps=12, checkpoint_every_steps=7, keep_best=True, early_stop_patience=3)
    assert summary["resumed_from"] == 7 and summary["steps"] == 9  # evaluations 7, 8, 9 without an improvement
    assert summary["best"]["kept"]["step"] == 6


def test_a_better_copy_kept_before_a_rollback_is_not_replaced_by_a_worse_one(tmp_path):
    """A resume that finds its newest checkpoints corrupted goes back past the kept best; a
    replay that evaluates lower (a job that does not replay exactly) keeps the better copy."""
    drive(tmp_path, Overfits(), max_steps=7, keep_best=True)
    main = tmp_path / "r" / "checkpoints"
    for step in (6, 7):
        (main / f"{step:010d}" / "MANIFEST.json").unlink()  # torn: the resume loads step 5

    class Replays(Overfits):
        def step(self, step):
            out = super().step(step)
            if step + 1 == 6:
                out["val_acc"] = 0.77
            return out

    with pytest.warns(UserWarning, match="skipping checkpoint"):
        d, summary = drive(tmp_path, Replays(), max_steps=8, keep_best=True)
    assert summary["resumed_from"] == 5
    assert summary["best"]["kept"]["step"] == 6 and summary["best"]["kept"]["value"] == 0.78
    assert [e["value"] for e in events(tmp_path, "best_not_replaced")] == [0.77, 0.775]  # steps 6 and 7 improve on step 5, not on the copy
    step, state = CheckpointStore(str(main / "best")).load()
    assert step == 6 and np.array_equal(state["workload"]["w"], weights_after(6))


def test_keep_best_on_a_metric_the_job_does_not_report_is_refused_before_ray(tmp_path):
    spec = registry.get("linreg")
    conf = prepare.job_config(spec, overrides=["driver.keep_best=true", "driver.best_metric=auc", f"driver.runs_dir={tmp_path}"])
    with pytest.raises(cfg.ConfigError, match=r"linreg: driver.best_metric='auc': job 'linreg' does not report it; it reports loss"):
        prepare.build(spec, conf, quiet=True)
    with pytest.raises(cfg.ConfigError, match=r"driver.best_mode"):
        prepare.job_config(spec, overrides=["driver.best_mode=up"])
    with pytest.raises(DriverError, match=r"does not report it"):
        Driver(Overfits(), DriverConfig(runs_dir=str(tmp_path), keep_best=True, best_metric="auc"), cluster_source=lambda: VIEW, poll_events=False)
