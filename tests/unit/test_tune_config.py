"""``raylane tune``: a trial's config (file <- sampled values <- --set), keys under a
job's free-form mapping (xgboost's params), what the search decides and says, and the
trial's reporter handing Tune only the steps that carry the metric (no Ray)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from raylane import config as cfg
from raylane.tune.run import Search, prepare
from raylane.tune.space import SearchSpaceError, check_space, flatten, parse_search, trial_config
from raylane.tune.trial import TuneReport
from raylane.workload import DriverError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@dataclasses.dataclass
class Job:
    lr: float = cfg.field(0.1, gt=0)
    """Step size."""
    params: dict[str, Any] = cfg.field(default_factory=dict)
    """Free-form library parameters."""


def test_keys_under_a_free_form_mapping_are_searchable_and_typed():
    check_space(Job, parse_search(["params.eta=uniform(0.1,0.5)", "params.max_depth=randint(2,6)"]))
    assert cfg.check_value(Job, "params.eta", 0.3) == 0.3
    with pytest.raises(SearchSpaceError, match="'paramz.eta' is not a key of Job; did you mean 'params'"):
        check_space(Job, parse_search(["paramz.eta=uniform(0.1,0.5)"]))
    with pytest.raises(SearchSpaceError, match="'lr.x' is not a key"):  # lr is a number, not a mapping
        check_space(Job, parse_search(["lr.x=uniform(0.1,0.5)"]))


def test_a_trial_config_is_the_file_then_the_sampled_values_then_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.05\nparams: {eta: 0.9, max_depth: 3}\n")
    conf = trial_config(SimpleNamespace(config_cls=Job), {"lr": 0.2, "params.eta": 0.25}, str(f), ["params.gamma=1.5"])
    assert conf.lr == 0.2  # the sampled value, not the file's
    assert conf.params == {"eta": 0.25, "max_depth": 3, "gamma": 1.5}  # a mapping merges key by key
    assert flatten({"a": {"b": 1, "c": {}}, "d": 2}) == {"a.b": 1, "a.c": {}, "d": 2}


def test_a_searched_key_in_the_config_file_is_said_not_used(tmp_path):
    f = tmp_path / "linreg.yaml"
    f.write_text("lr: 0.07\nworkers: 1\n")
    prep = prepare(Search(job="linreg", space=parse_search(["lr=loguniform(0.01,0.5)"]), config_file=str(f)))
    assert f"lr: searched; the value 0.07 in {f} is not used" in prep.notes


def test_xgboost_params_are_searched_and_checked_by_the_job_itself():
    prep = prepare(Search(job="xgboost", space=parse_search(["params.eta=uniform(0.1,0.5)", "params.max_depth=randint(2,6)"])))
    assert (prep.metric, prep.mode) == ("eval-logloss", "min")
    with pytest.raises(cfg.ConfigError, match="params.etaa: xgboost .* has no parameter 'etaa'; did you mean eta"):
        prepare(Search(job="xgboost", space=parse_search(["params.etaa=uniform(0.1,0.5)"])))


def test_the_schedulers_choices_are_said():
    asha = prepare(Search(job="linreg", space=parse_search(["lr=uniform(0.1,0.3)"]), scheduler="asha", grace_steps=500,
                          overrides=["driver.max_steps=40"]))
    assert any(n.startswith("asha: every trial runs at least 40 steps; the longest run 40") and "--grace-steps 500" in n for n in asha.notes)
    pbt = prepare(Search(job="linreg", space=parse_search(["lr=uniform(0.1,0.3)"]), scheduler="pbt", overrides=["driver.checkpoint_every_steps=5"]))
    assert "pbt: perturbation interval 5 steps (driver.checkpoint_every_steps; --perturbation-interval changes it)" in pbt.notes
    assert pbt.search.perturbation_interval == 5


def test_declared_metrics_include_each_jobs_main_metric():
    from raylane import registry
    from raylane.prepare import build as build_workload

    for job in ("linreg", "ppo", "impala", "graphsage", "pipeline_lm", "ps_ctr", "federated", "xgboost"):
        spec = registry.get(job)
        overrides = ["graph.nodes=2000"] if job == "graphsage" else []
        w = build_workload(spec, cfg.load_config(spec.config_cls, overrides=overrides))
        try:
            assert w.main_metric in w.metrics, (job, w.main_metric, w.metrics)
            assert len(set(w.metrics)) == len(w.metrics), job
        finally:
            w.close()


def test_steps_without_the_metric_are_not_handed_to_tune_when_it_is_declared():
    r = TuneReport("t0", "test_acc", "graphsage", declared=True)
    assert r.row(1, {"loss": 0.9}) is None  # no evaluation yet: nothing for Tune
    assert r.row(2, {"loss": 0.8, "test_acc": float("nan")}) is None  # not a value either
    row = r.row(3, {"loss": 0.7, "test_acc": 0.6})
    assert (row["step"], row["test_acc"]) == (3, 0.6) and r.last_row["step"] == 3
    assert r.row(10, {"loss": 0.5}) is None  # the last step, without the metric: the final result stays step 3's
    assert r.last_row["step"] == 3 and r.final_row["step"] == 10


def test_an_undeclared_metric_missing_at_the_first_step_stops_the_trial_naming_it():
    r = TuneReport("t0", "test_acc", "graphsage", declared=False)
    with pytest.raises(DriverError, match=r"--metric 'test_acc': job 'graphsage' did not report it at step 1; it reports \['loss', 'step'\]"):
        r.row(1, {"loss": 0.9})


def _checkpoint(store, step: int) -> str:
    return store.save(step, {"step": step, "w": [float(step)]}).path


def _tune_copy(tmp_path, store, step: int, trial: str) -> str:
    """A checkpoint as RaylaneTrial.save_checkpoint hands it to Tune: the files and its origin."""
    import json
    import shutil

    from raylane.tune.trial import ORIGIN

    dst = tmp_path / f"tune-{trial}-{step}"
    shutil.copytree(_checkpoint(store, step), dst)
    (dst / ORIGIN).write_text(json.dumps({"trial": trial, "step": step}))
    return str(dst)


def _restoring(tmp_path):
    """A RaylaneTrial as Tune's restore finds it, its own store holding steps 5 and 10 (no Ray needed)."""
    from raylane.checkpoint import CheckpointStore
    from raylane.tune.trial import RaylaneTrial

    trial = object.__new__(RaylaneTrial)
    trial._trial_info = SimpleNamespace(trial_id="t1")
    trial.store, trial.values = CheckpointStore(str(tmp_path / "own"), keep=5), {"lr": 0.1}
    for step in (5, 10):
        _checkpoint(trial.store, step)
    return trial


def test_a_restored_trial_keeps_its_own_newer_checkpoint_over_tunes_older_copy(tmp_path):
    from raylane.checkpoint import CheckpointStore

    trial = _restoring(tmp_path)
    # the process was lost after writing step 10 and before Tune copied it: Tune holds step 5
    trial.load_checkpoint(_tune_copy(tmp_path, CheckpointStore(str(tmp_path / "old"), keep=5), 5, "t1"))
    assert trial.restored["step"] == 10 and trial.restored["tune_step"] == 5 and trial.store.steps() == [5, 10]
    assert trial.restored["kind"] == "tune_restore"


def test_a_restored_trial_takes_tunes_copy_when_it_is_the_newest_or_a_donors(tmp_path):
    from raylane.checkpoint import CheckpointStore

    trial = _restoring(tmp_path)
    other = CheckpointStore(str(tmp_path / "donor"), keep=5)
    trial.load_checkpoint(_tune_copy(tmp_path, other, 3, "t2"))  # PBT: a donor's step 3, older than the own store's
    assert trial.restored == {"kind": "tune_exploit", "step": 3, "donor": "t2", "path": trial.restored["path"]}
    assert trial.store.steps() == [3]
    trial = _restoring(tmp_path / "again")
    trial.load_checkpoint(_tune_copy(tmp_path, other, 12, "t1"))  # Tune's own copy is the newest
    assert trial.restored["step"] == 12 and "tune_step" not in trial.restored and trial.store.steps() == [12]


def test_an_exploited_trial_lost_before_its_own_checkpoint_is_restored_not_exploited_again(tmp_path):
    from raylane.checkpoint import CheckpointStore

    trial = _restoring(tmp_path)
    donors_copy = _tune_copy(tmp_path, CheckpointStore(str(tmp_path / "donor"), keep=5), 12, "t2")
    trial.load_checkpoint(donors_copy)  # PBT: t1 takes t2's step 12 with its new values
    assert trial.restored["kind"] == "tune_exploit" and trial.store.steps() == [12]
    # the process is lost after t1 wrote step 14 and before Tune copied it: Tune hands back t2's copy again
    _checkpoint(trial.store, 14)
    trial.load_checkpoint(donors_copy)
    assert trial.restored["kind"] == "tune_restore" and trial.restored["step"] == 14 and trial.restored["tune_step"] == 12
    assert trial.store.steps() == [12, 14]  # the step written since the exploit is kept
    # lost before step 14: the adopted copy again, a restore
    trial = _restoring(tmp_path / "again")
    trial.load_checkpoint(donors_copy)
    trial.load_checkpoint(donors_copy)
    assert trial.restored["kind"] == "tune_restore" and trial.restored["step"] == 12
    # another exploit of the same copy comes with other values: an exploit
    trial.values = {"lr": 0.12}
    trial.load_checkpoint(donors_copy)
    assert trial.restored["kind"] == "tune_exploit"


def test_a_run_that_never_reported_the_metric_says_so_in_its_events(tmp_path, capsys):
    from raylane.runlog import read_jsonl
    from raylane.tune.trial import RaylaneTrial

    trial = object.__new__(RaylaneTrial)
    trial._trial_info = SimpleNamespace(trial_id="t1")
    trial.plan, trial.run_dir = SimpleNamespace(metric="test_acc"), tmp_path
    trial._no_metric(4)
    (event,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "tune_no_metric"]
    assert (event["metric"], event["step"]) == ("test_acc", 4)
    assert "ended at step 4 without a value of 'test_acc'" in capsys.readouterr().err
