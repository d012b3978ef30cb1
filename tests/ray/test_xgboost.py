"""XGBoost trainers on one local Ray: training, metrics through the collective, a trainer
killed mid-chunk, and a driver killed mid-run (a real ``python -m raylane.jobs.xgboost``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xgboost as xgb

from raylane.actors.tabular import eval_mask, read_rows
from raylane.checkpoint import CheckpointStore
from raylane.driver import Driver, DriverConfig
from raylane.jobs.xgboost import DataConfig, XGBoostJobConfig, XGBoostWorkload, prepare
from raylane.runlog import read_jsonl

from harness import drive, ranks_now  # tests/harness.py
from market_helpers import wait_all_free as wait_cpus_free  # tests/market_helpers.py

# Generous: the collective synchronises every tree level, so on 2 cores shared with other
# test runs a chunk can take 20x longer than on a quiet machine.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# Big enough that a chunk of 10 rounds (~0.3 s here) takes far longer than the driver's work
# between two steps (a few ms): a fault injected as a step starts lands mid-chunk.
FAULT_DATA = {"source": "synthetic:classification", "rows": 200_000, "num_features": 16, "seed": 3}
FAULT_ROUNDS = 30


def make(tmp_path: Path, name: str, *, data: dict, every: int = 10, **kw) -> XGBoostJobConfig:
    conf = XGBoostJobConfig(data=DataConfig(**data), checkpoint_every=every, **kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), checkpoint_every_steps=1, progress=False, tensorboard=False)
    return conf


def held_out(conf: XGBoostJobConfig) -> tuple[np.ndarray, np.ndarray]:
    """The evaluation rows of the whole table, read in the test process."""
    table = prepare(conf).table
    x, y = read_rows(table, 0, table.rows)
    mask = eval_mask(conf.data.seed, 0, table.rows, conf.data.eval_fraction)
    return x[mask], y[mask]


def logloss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), 1e-16, 1 - 1e-16)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    """A fault-free run of the fault tests' problem."""
    wait_cpus_free()
    tmp = tmp_path_factory.mktemp("reference")
    conf = make(tmp, "reference", data=FAULT_DATA, num_boost_round=FAULT_ROUNDS, params={"eval_metric": ["logloss"]})
    summary = Driver(XGBoostWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["final_metrics"]["round"] == FAULT_ROUNDS
    return summary["final_metrics"], (tmp / "reference" / "model.ubj").read_bytes()


def test_breast_cancer_trains_and_metrics_are_aggregated_over_trainers(ray_local, tmp_path):
    wait_cpus_free()
    conf = make(tmp_path, "bc", data={"source": "sklearn:breast_cancer"}, num_boost_round=30, trainers=2)
    summary = Driver(XGBoostWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["steps"] == 3
    final = summary["final_metrics"]
    assert final["round"] == 30 and final["trainers"] == 2
    assert final["eval-auc"] > 0.95 and final["train-logloss"] < final["eval-logloss"]
    run = tmp_path / "bc"
    booster = xgb.Booster(model_file=str(run / "model.ubj"))  # plain xgboost loads it
    assert booster.num_boosted_rounds() == 30
    rounds = read_jsonl(run / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(1, 31))
    assert rounds[-1]["eval-logloss"] == final["eval-logloss"]
    # Each trainer evaluates only its own held-out rows; the logloss reported must be the one
    # of the model over all of them, so it was aggregated through the collective.
    names = list(prepare(conf).table.features)
    assert booster.feature_names == names  # the model knows its columns
    x, y = held_out(conf)
    assert len(y) > 50
    assert abs(logloss(booster.predict(xgb.DMatrix(x, feature_names=names)), y) - final["eval-logloss"]) < 1e-5
    history = json.loads((run / "history.json").read_text())
    assert len(history["eval-auc"]) == 30
    chosen = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "xgboost_objective"]
    assert [(e["objective"], e["inferred"], e["reason"]) for e in chosen] == [("binary:logistic", True, "every label is 0 or 1")]


def test_iris_without_an_objective_trains_multiclass_and_says_so(ray_local, tmp_path, capsys):
    wait_cpus_free()
    conf = make(tmp_path, "iris", data={"source": "sklearn:iris"}, num_boost_round=10, trainers=2)
    summary = Driver(XGBoostWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished"
    shown = capsys.readouterr().out
    assert "xgboost: objective multi:softprob, num_class=3 (chosen from the labels: class indices 0..2, 3 classes" in shown
    chosen = [e for e in read_jsonl(tmp_path / "iris" / "events.jsonl") if e["event"] == "xgboost_objective"]
    assert len(chosen) == 1 and chosen[0]["objective"] == "multi:softprob" and chosen[0]["inferred"] and chosen[0]["num_class"] == 3
    assert chosen[0]["eval_metric"] == ["mlogloss", "merror"]
    final = summary["final_metrics"]
    assert {"eval-mlogloss", "eval-merror", "train-mlogloss"} <= set(final) and not any("rmse" in k for k in final)
    booster = xgb.Booster(model_file=str(tmp_path / "iris" / "model.ubj"))
    config = json.loads(booster.save_config())["learner"]
    assert config["objective"]["name"] == "multi:softprob" and config["learner_model_param"]["num_class"] == "3"
    x, y = held_out(conf)
    p = booster.predict(xgb.DMatrix(x, feature_names=list(prepare(conf).table.features)))
    assert p.shape == (len(y), 3)
    assert float(np.mean(p.argmax(axis=1) != y)) == pytest.approx(final["eval-merror"], abs=1e-6)


def test_string_columns_train_as_categories_across_trainers_and_say_so(ray_local, tmp_path, capsys):
    """Two trainers, two files: 'madrid' is only in the second trainer's rows, yet both code
    the cities with the driver's one list, so the collective's trees split on the same sets."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cities = ["paris", "oslo", "berlin", "lyon", "madrid"]
    folder = tmp_path / "clicks"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, (n, known) in enumerate(((3000, cities[:4]), (3000, cities))):
        city = [known[k] for k in rng.integers(0, len(known), n)]
        pq.write_table(pa.table({"city": city, "noise": rng.normal(size=n), "id": [f"u{i}-{j}" for j in range(n)],
                                 "y": [int(c in ("berlin", "madrid", "paris")) for c in city]}), folder / f"part-{i}.parquet")
    wait_cpus_free()
    conf = make(tmp_path, "cats", data={"source": str(folder), "label": "y", "drop": ["id"]}, num_boost_round=10, trainers=2)
    summary = Driver(XGBoostWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished"
    assert "categorical features: city (5 categories)" in capsys.readouterr().out
    said = [e for e in read_jsonl(tmp_path / "cats" / "events.jsonl") if e["event"] == "xgboost_categorical"]
    assert len(said) == 1 and said[0]["columns"] == {"city": 5}
    assert summary["final_metrics"]["eval-auc"] == 1.0 and summary["final_metrics"]["eval-logloss"] < 0.1
    booster = xgb.Booster(model_file=str(tmp_path / "cats" / "model.ubj"))
    assert booster.feature_names == ["city", "noise"] and booster.feature_types == ["c", "q"]


def test_one_trainer_equals_plain_xgboost_and_two_trainers_are_close(ray_local, tmp_path):
    data = {"source": "synthetic:regression", "rows": 20_000, "num_features": 8, "seed": 1}
    finals = {}
    for n in (1, 2):
        wait_cpus_free()
        conf = make(tmp_path, f"n{n}", data=data, num_boost_round=20, trainers=n)
        summary = Driver(XGBoostWorkload(conf), conf.driver).run()
        assert summary["state"] == "finished"
        finals[n] = summary["final_metrics"]
    table = prepare(conf).table
    x, y = read_rows(table, 0, table.rows)
    mask = eval_mask(data["seed"], 0, table.rows, conf.data.eval_fraction)
    # One trainer in a collective of one is plain xgboost on the same rows.
    params = {**prepare(conf).params, "nthread": 1}
    dtrain = xgb.QuantileDMatrix(x[~mask], y[~mask], nthread=1)
    xgb.train(params, dtrain, 20, evals=[(xgb.QuantileDMatrix(x[mask], y[mask], ref=dtrain, nthread=1), "eval")], evals_result=(res := {}), verbose_eval=False)
    assert res["eval"]["rmse"][-1] == pytest.approx(finals[1]["eval-rmse"], abs=1e-6)
    # Two trainers: each holds half the training rows, yet the train-rmse reported is the
    # one of the (single, shared) model over all of them.
    two = xgb.Booster(model_file=str(tmp_path / "n2" / "model.ubj"))
    rmse = float(np.sqrt(np.mean((two.predict(xgb.DMatrix(x[~mask], feature_names=list(table.features))) - y[~mask]) ** 2)))
    assert rmse == pytest.approx(finals[2]["train-rmse"], abs=1e-5)
    # Two shards agree on quantile cuts through the collective, so the trees differ a little
    # from one trainer's (observed: a few percent either way, depending on the rows).
    assert finals[2]["eval-rmse"] == pytest.approx(finals[1]["eval-rmse"], rel=0.05), finals


def test_trainer_killed_mid_chunk_regroups_and_matches_fault_free_run(ray_local, tmp_path, reference):
    ref_metrics, ref_model = reference
    wait_cpus_free()
    conf = make(tmp_path, "killed", data=FAULT_DATA, num_boost_round=FAULT_ROUNDS, params={"eval_metric": ["logloss"]})
    workload = XGBoostWorkload(conf)
    run_dir = tmp_path / "killed"
    killed: list[int] = []

    def kill():
        # The group streams chunk 2 (rounds 11-20) while the driver checkpoints chunk 1.
        pid = ranks_now(run_dir, "xgboost_group", "pids")[1]
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    run = drive(workload, conf.driver, at={1: kill})
    summary, events = run.summary, run.events
    assert killed and summary["state"] == "finished", summary
    assert summary["failures_recovered"] == 1
    failure = next(e for e in events if e["event"] == "failure")
    assert "shard 1: trainer lost" in failure["error"] and failure["decision"] == "recover"
    resumes = [e["round"] for e in events if e["event"] == "xgboost_resume"]
    assert resumes == [10], resumes  # back to the last checkpointed round, not to the start
    regroup = [e for e in events if e["event"] == "xgboost_group"][-1]
    assert regroup["loaded"] == [1] and regroup["kept"] == [0]  # the survivor kept its rows
    final = summary["final_metrics"]
    assert abs(final["eval-logloss"] - ref_metrics["eval-logloss"]) < 1e-3
    # Same shards, same ranks, a restart at a chunk boundary: hist + the collective give the
    # very same trees, so the model is bit-for-bit the fault-free one (stronger than the 1e-3).
    assert (tmp_path / "killed" / "model.ubj").read_bytes() == ref_model


def launch(tmp_path: Path, name: str, every: int) -> subprocess.Popen:
    sets = [f"data.{k}={v}" for k, v in FAULT_DATA.items()] + [f"num_boost_round={FAULT_ROUNDS}", f"checkpoint_every={every}", "params.eval_metric=[logloss]", f"driver.runs_dir={tmp_path}", "driver.tensorboard=false"]
    cmd = [sys.executable, "-m", "raylane.jobs.xgboost", "--run-name", name, "--no-progress"] + [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


# 30-45 s, in the default run: the exactness of a resume is a promise of the README
def test_sigkilled_driver_resumes_from_last_checkpoint(tmp_path, reference):
    ref_metrics, ref_model = reference
    run_dir = tmp_path / "victim"
    victim = launch(tmp_path, "victim", every=5)  # the chunk size does not change the model
    deadline = time.time() + 400
    # Wait for the second checkpoint itself (its event follows the save), not for the second
    # metrics row: the driver checks events and pools between the two, and a kill in that gap
    # on a busy machine leaves only the first.
    while time.time() < deadline and not any(e["event"] == "checkpoint" and e["step"] >= 2 for e in read_jsonl(run_dir / "events.jsonl")):
        assert victim.poll() is None, victim.stdout.read()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the driver, its embedded Ray and the trainers
    victim.wait(timeout=30)
    last = CheckpointStore(str(run_dir / "checkpoints")).latest()
    done_steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert last is not None and 2 <= last.step < 6 and last.step <= done_steps
    out, _ = (again := launch(tmp_path, "victim", every=5)).communicate(timeout=400)
    assert again.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["resumed_from"] == last.step, out
    assert [e["round"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "xgboost_resume"] == [5 * last.step]
    assert abs(summary["final_metrics"]["eval-logloss"] - ref_metrics["eval-logloss"]) < 1e-3
    assert (run_dir / "model.ubj").read_bytes() == ref_model


def test_frozen_trainer_cannot_hang_the_group(ray_local, tmp_path):
    """A trainer that stops answering (SIGSTOP: its sockets stay open, like a node gone from
    the network) is not seen as dead by anyone. The survivor's collective operation times
    out, the frozen trainer is killed once the grace period is over, and the run goes on."""
    wait_cpus_free()
    conf = make(tmp_path, "frozen", data=FAULT_DATA, num_boost_round=20, collective_timeout_s=6, params={"eval_metric": ["logloss"]})
    workload = XGBoostWorkload(conf)
    run_dir = tmp_path / "frozen"
    frozen: list[int] = []

    def freeze():
        frozen.append(ranks_now(run_dir, "xgboost_group", "pids")[1])
        os.kill(frozen[0], signal.SIGSTOP)

    t0 = time.monotonic()
    run = drive(workload, conf.driver, at={1: freeze})
    summary = run.summary
    assert frozen and summary["state"] == "finished" and summary["failures_recovered"] == 1, summary
    failure = next(e for e in run.events if e["event"] == "failure")
    assert "shard 0: " in failure["error"] and "timeout" in failure["error"].lower()
    assert "shard 1: still in the collective 11 s after the first failure, killed" in failure["error"]
    assert time.monotonic() - t0 < 300


def test_the_best_round_exports_and_loads_without_ray_to_the_runs_own_held_out_logloss(ray_local, tmp_path):
    """driver.keep_best on the held-out logloss, then ``raylane export --best``; another
    process, Ray not started there, loads the model with raylane.api.load_model."""
    wait_cpus_free()
    conf = make(tmp_path, "bcbest", data={"source": "sklearn:breast_cancer"}, num_boost_round=60, trainers=2, every=5,
                params={"eta": 0.6, "eval_metric": ["logloss"]})
    conf.driver.keep_best, conf.driver.best_metric = True, "eval-logloss"
    summary = Driver(XGBoostWorkload(conf), conf.driver).run()
    kept = summary["best"]["kept"]
    assert summary["state"] == "finished" and kept["value"] == min(r["eval-logloss"] for r in read_jsonl(tmp_path / "bcbest" / "metrics.jsonl"))
    x, y = held_out(conf)
    np.save(tmp_path / "x.npy", x)
    result = subprocess.run([sys.executable, "-m", "raylane", "export", "bcbest", "--best", "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "exported to" in result.stdout, result.stderr
    script = ("import sys, numpy as np, ray, xgboost as xgb; from raylane.api import load_model; "
              f"b = load_model({str(tmp_path / 'bcbest' / 'export-best')!r}); assert not ray.is_initialized(); "
              f"np.save({str(tmp_path / 'p.npy')!r}, b.predict(xgb.DMatrix(np.load({str(tmp_path / 'x.npy')!r}), feature_names=b.feature_names))); "
              "print(b.num_boosted_rounds())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 5 * kept["step"]  # the trees of the best chunk, not of the last one
    assert abs(logloss(np.load(tmp_path / "p.npy"), y) - kept["value"]) < 1e-5
    manifest = json.loads((tmp_path / "bcbest" / "export-best" / "export.json").read_text())
    assert manifest["step"] == kept["step"] and set(manifest["files"]) == {"model.ubj"}
