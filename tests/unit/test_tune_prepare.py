"""``raylane tune`` before Ray starts: metric and mode, scheduler needs, the concurrency a
cluster could hold; and the trials' table read back from run folders (no Ray)."""

from __future__ import annotations

import io
import json
import time

import pytest

from raylane.runlog import RunLog
from raylane.tune.results import command_line, rows, trial_row, write
from raylane.tune.run import Search, check_concurrency, metric_mode, prepare, trial_demand
from raylane.tune.space import SearchSpaceError, nest, parse_search
from raylane.tune.trial import scalars

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def search(**kw) -> Search:
    kw.setdefault("space", parse_search(["lr=loguniform(0.01,0.5)"]))
    return Search(job=kw.pop("job", "linreg"), **kw)


@pytest.mark.parametrize("metric,mode", [("loss", "min"), ("return_mean", "max"), ("test_acc", "max"), ("auc", "max"),
                                         ("valid-rmse", "min"), ("weight_error", "min"), ("tokens_per_s", "max"), ("round", None)])
def test_metric_mode_from_the_name(metric, mode):
    assert metric_mode(metric) == mode


def test_prepare_takes_the_main_metric_and_says_so():
    prep = prepare(search())
    assert (prep.metric, prep.mode, prep.n_trials) == ("loss", "min", 4)
    assert prep.notes == ["metric: loss (min), the job's main metric"]


@pytest.mark.parametrize("kw,words", [
    ({"metric": "accuracy"}, ["--metric 'accuracy'", "does not report it", "weight_error"]),
    ({"metric": "workers", "mode": "up"}, ["--mode 'up'", "max or min"]),
    ({"scheduler": "hyperband"}, ["--scheduler 'hyperband'", "asha", "pbt"]),
    ({"scheduler": "pbt", "space": parse_search(["lr=grid([0.1, 0.2])"])}, ["grid()", "choice"]),
    ({"scheduler": "pbt", "overrides": ["driver.checkpoint_every_steps=0"]}, ["needs checkpoints"]),
    ({"pbt_synch": True}, ["--pbt-synch", "--scheduler is 'none'", "add --scheduler pbt"]),
    ({"scheduler": "pbt", "pbt_synch": "yes"}, ["pbt_synch='yes'", "True or False"]),
    ({"trials": 0}, ["--trials=0", ">= 1"]),
    ({"concurrency": 0}, ["--concurrency=0"]),
    ({"trial_cpus": 0}, ["--trial-cpus=0"]),
    ({"space": parse_search(["lr=loguniform(0.01,0.5)"]), "overrides": ["lr=0.1"]}, ["both fixed (--set) and searched"]),
    ({"space": parse_search(["lrr=uniform(0.1,0.2)"])}, ["'lrr'", "did you mean 'lr'"]),
])
def test_bad_searches_are_refused_before_ray_naming_the_value(kw, words):
    with pytest.raises(SearchSpaceError) as err:
        prepare(search(**kw))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_metric_with_no_direction_in_its_name_needs_a_mode():
    with pytest.raises(SearchSpaceError, match="--mode max or --mode min"):
        prepare(search(metric="workers"))
    assert prepare(search(metric="workers", mode="max")).mode == "max"


def test_pbt_aligns_the_checkpoints_with_its_perturbations_and_says_so():
    prep = prepare(search(scheduler="pbt", perturbation_interval=3))
    assert prep.base.driver.checkpoint_every_steps == 3 and "driver.checkpoint_every_steps=3" in prep.search.overrides
    assert any("checkpoint every 3 steps" in n for n in prep.notes)
    assert not any("synchronous" in n for n in prep.notes)
    synch = prepare(search(scheduler="pbt", perturbation_interval=3, pbt_synch=True))
    assert any(n.startswith("pbt: synchronous; every 3 steps") for n in synch.notes)


def test_a_concurrency_the_cluster_could_never_hold_names_what_is_missing():
    prep = prepare(search(overrides=["workers=2"], concurrency=3, trial_cpus=0.5))
    assert trial_demand(prep) == {"CPU": 1.5}  # its driver and the pool's minimum of one worker
    check_concurrency(prep, {"CPU": 4.5}, "the cluster")
    with pytest.raises(SearchSpaceError) as err:
        check_concurrency(prep, {"CPU": 4.0}, "the cluster")
    msg = str(err.value)
    assert "--concurrency 3" in msg and "CPU 4.5" in msg and "missing CPU 0.5" in msg and "At most 2 fit" in msg


def test_nest_and_scalars():
    assert nest({"lr": 1, "driver.max_steps": 5, "driver.x.y": 2}) == {"lr": 1, "driver": {"max_steps": 5, "x": {"y": 2}}}
    import numpy as np

    got = scalars({"a": 1, "b": np.float32(0.5), "c": [1, 2], "d": {"x": 1}, "e": True, "f": "ok"})
    assert got == {"a": 1, "b": 0.5, "e": True, "f": "ok"} and type(got["b"]) is float


def _fake_trial(root, trial, losses, values, events=()):
    log = RunLog(root / trial, tensorboard=False)
    log.event("tune_trial", trial=trial, values=values, metric="loss")
    for kind, kw in events:
        log.event(kind, **kw)
    for i, loss in enumerate(losses, 1):
        log.metrics(i, {"loss": loss})
        time.sleep(0.001)
    log.summary({"state": "finished", "steps": len(losses)})
    log.close()


def test_rows_come_from_the_trials_run_folders_best_first(tmp_path):
    _fake_trial(tmp_path, "t1", [3.0, 2.0, 1.5], {"lr": 0.1})
    _fake_trial(tmp_path, "t2", [2.0, 0.5, 0.7], {"lr": 0.3},
                events=[("tune_restore", {"step": 1, "donor": "t2"}), ("failure", {"decision": "recover"}), ("failure", {"decision": "fail"})])
    _fake_trial(tmp_path, "t3", [float("nan")], {"lr": 0.9}, events=[("tune_exploit", {"step": 4, "donor": "t2"})])
    table = rows(tmp_path, "loss", "min", {"t3": "error"})
    assert [r["trial"] for r in table] == ["t2", "t1", "t3"]
    t2 = table[0]
    assert (t2["best_loss"], t2["last_loss"], t2["steps"], t2["restarts"], t2["exploits"], t2["resumed_from"], t2["failures_recovered"]) == \
        (0.5, 0.7, 3, 1, 0, [1], 1)
    assert table[2]["state"] == "error" and table[2]["best_loss"] is None and table[2]["exploits"] == 1
    assert rows(tmp_path, "loss", "max")[0]["trial"] == "t1"
    files = write(tmp_path, table, "loss")
    assert json.loads(files["json"].read_text())[0]["trial"] == "t2"
    assert files["csv"].read_text().splitlines()[0].startswith("trial,config/lr,best_loss")
    assert files["png"].stat().st_size > 5_000
    assert trial_row(tmp_path / "t1", "loss", "min")["config/lr"] == 0.1
    # a narrow terminal folds the table's cells; it never cuts a trial id or a value short
    from rich.console import Console

    from raylane.tune.results import table as render

    narrow = Console(width=60, record=True, file=io.StringIO())
    narrow.print(render(table, "loss"))
    text = narrow.export_text()
    assert "…" not in text and "t2" in text and " 0.1 " in text and " 0.3 " in text, text


def test_the_best_command_line_quotes_what_a_shell_would_split():
    row = {"trial": "t", "config/activation": "relu", "config/hidden": [64, 64], "config/lr": 0.001}
    line = command_line("ppo", ["env_id=CartPole-v1"], "base.yaml", row)
    assert line == "raylane run ppo --config base.yaml --set env_id=CartPole-v1 --set 'activation=\"relu\"' --set 'hidden=[64, 64]' --set lr=0.001"


@pytest.mark.parametrize("args,words", [
    (["linreg", "--search", "lr=logunifrom(1e-3,1e-1)"], ["unknown spec", "loguniform"]),
    (["linreg", "--search", "lrr=uniform(0.1,0.2)"], ["did you mean 'lr'"]),
    (["linreg", "--search", "lr=uniform(0.1,0.2)", "--concurrency", "64"], ["--concurrency 64", "missing CPU"]),
    (["nosuchjob", "--search", "lr=uniform(0.1,0.2)"], ["nosuchjob"]),
    (["linreg"], ["search space is empty"]),
])
def test_the_command_line_refuses_bad_searches_before_ray_starts(args, words, tmp_path):
    from typer.testing import CliRunner

    from raylane.cli import app

    res = CliRunner().invoke(app, ["tune", *args, "--runs-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    import ray

    assert not ray.is_initialized()


def test_a_search_file_and_a_submitted_config_are_read_by_the_one_yaml_reader(tmp_path):
    """A key given twice in --search-file, or in a config file sent with raylane submit, is
    refused naming it (plain PyYAML would keep the last one silently)."""
    from typer.testing import CliRunner

    from raylane import config as cfg
    from raylane.cli import app
    from raylane.submission import config_overrides

    twice = tmp_path / "twice.yaml"
    twice.write_text("lr: uniform(0.1,0.2)\nlr: uniform(0.2,0.3)\n")
    res = CliRunner().invoke(app, ["tune", "linreg", "--search-file", str(twice), "--runs-dir", str(tmp_path)])
    assert res.exit_code == 2 and "duplicate key 'lr'" in res.output, res.output
    with pytest.raises(cfg.ConfigError, match="duplicate key 'lr'"):
        config_overrides(str(twice), [])
