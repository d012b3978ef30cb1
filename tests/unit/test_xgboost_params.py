"""XGBoost params settled before Ray starts: parameter names checked against the installed
xgboost, and the objective chosen from the labels when none is given. No Ray."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from typer.testing import CliRunner

from raylane import config as cfg
from raylane.actors.tabular import LabelSummary
from raylane.cli import app
from raylane.jobs.xgboost import XGBoostJobConfig, prepare
from raylane.jobs.xgboost_params import MAX_CLASSES, class_count, infer_objective, known_params

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def load(*overrides: str) -> XGBoostJobConfig:
    return config("xgboost", *overrides)


def refused(*overrides: str) -> str:
    with pytest.raises(cfg.ConfigError) as info:
        load(*overrides)
    return " ".join(str(info.value).split())


# ---------------------------------------------------------------- parameter names


def test_known_params_are_read_from_the_installed_xgboost():
    known = known_params()
    # general, tree booster, learning task; the aliases xgboost accepts
    assert {"booster", "device", "seed", "max_depth", "eta", "learning_rate", "gamma", "min_split_loss", "lambda", "reg_lambda",
            "alpha", "reg_alpha", "subsample", "colsample_bytree", "max_bin", "grow_policy", "objective", "base_score", "num_class"} <= known
    # what only some objectives and boosters read, and what the saved config keeps elsewhere
    assert {"quantile_alpha", "huber_slope", "tweedie_variance_power", "scale_pos_weight", "rate_drop", "top_k", "eval_metric", "verbosity"} <= known
    assert not {"max_dpeth", "name", "n_estimators", "early_stopping_rounds", "lambdarank_pair_method"} & known


@pytest.mark.parametrize("typo, nearest", [("max_dpeth", "max_depth"), ("etaa", "eta"), ("colsample_by_tree", "colsample_bytree"), ("random_stat", "random_state"), ("learningrate", "learning_rate")])
def test_a_misspelt_param_is_refused_naming_the_nearest_valid_one(typo, nearest):
    msg = refused(f"params={{{typo}: 3}}")
    assert f"params.{typo}: xgboost" in msg and f"has no parameter '{typo}'; did you mean {nearest}?" in msg
    assert not ray.is_initialized()


def test_a_param_with_no_near_name_lists_every_valid_one():
    msg = refused("params={zzz: 1}")
    assert "has no parameter 'zzz'; its parameters are:" in msg and "max_depth" in msg and "subsample" in msg


def test_every_unknown_param_is_named_in_one_error():
    msg = refused("params={max_dpeth: 3, etaa: 0.1, subsample: 0.5}")
    assert "params.max_dpeth" in msg and "did you mean max_depth?" in msg and "params.etaa" in msg and "did you mean eta?" in msg
    assert "subsample" not in msg


def test_an_objective_written_without_a_space_after_the_colon_is_explained():
    assert cfg.parse_override("params={objective:nosuch}") == ("params", {"objective:nosuch": None})  # what YAML makes of it
    msg = refused("params={objective:nosuch}")
    assert "'objective:nosuch' looks like `objective: nosuch` missing a space after the colon" in msg and "write {objective: nosuch}" in msg
    msg = refused("params={max_depth:3}")
    assert "looks like `max_depth: 3` missing a space after the colon" in msg


def test_an_objective_name_given_as_a_key_is_explained():
    msg = refused("params={binary:logistic}")
    assert "'binary:logistic' is given as a key with no value" in msg and "{objective: binary:logistic}" in msg


def test_a_known_param_with_no_value_is_refused():
    # xgboost drops a None value without a word: the default would train instead
    msg = refused("params={seed: }")
    assert "params.seed: no value" in msg


def test_valid_names_and_aliases_pass():
    prep = prepare(load("data.source=sklearn:breast_cancer", "params={learning_rate: 0.1, reg_lambda: 2, min_split_loss: 0.5, max_depth: 3, verbosity: 0}"))
    assert prep.params["learning_rate"] == 0.1 and prep.params["max_depth"] == 3


def test_cli_refuses_a_param_typo_before_ray_starts():
    result = CliRunner().invoke(app, ["run", "xgboost", "--set", "params={max_dpeth: 3}"])
    assert result.exit_code == 2 and "did you mean max_depth?" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["run", "xgboost", "--set", "params={objective:nosuch}"])
    assert result.exit_code == 2 and "missing a space after the colon" in " ".join(result.output.split())
    assert not ray.is_initialized()


# ---------------------------------------------------------------- the objective


@pytest.mark.parametrize("source, classes", [("sklearn:iris", 3), ("sklearn:wine", 3), ("sklearn:digits", 10)])
def test_class_labels_train_multiclass_without_an_objective(source, classes):
    prep = prepare(load(f"data.source={source}"))
    choice = prep.objective
    assert prep.params["objective"] == "multi:softprob" and prep.params["num_class"] == classes
    assert prep.metrics == ("mlogloss", "merror")
    assert choice.inferred and choice.num_class == classes and f"class indices 0..{classes - 1}, {classes} classes" in choice.reason
    line = choice.line(prep.metrics)
    assert line.startswith(f"xgboost: objective multi:softprob, num_class={classes} (chosen from the labels:") and "set params.objective" in line
    event = json.loads(json.dumps(choice.event(prep.metrics)))  # goes to events.jsonl as it is
    assert event["objective"] == "multi:softprob" and event["inferred"] and event["num_class"] == classes and event["labels"]["distinct"] == classes


def test_zero_one_labels_train_binary():
    prep = prepare(load("data.source=sklearn:breast_cancer"))
    assert prep.params["objective"] == "binary:logistic" and "num_class" not in prep.params and prep.metrics == ("logloss", "auc")
    assert prep.objective.inferred and prep.objective.reason == "every label is 0 or 1"


def test_real_valued_labels_train_regression():
    prep = prepare(load("data.source=synthetic:regression", "data.rows=2000"))
    assert prep.params["objective"] == "reg:squarederror" and prep.metrics == ("rmse",)
    assert prep.objective.inferred and prep.objective.reason == "not all whole numbers"


def test_whole_number_labels_that_are_not_class_indices_train_regression_and_say_why():
    prep = prepare(load("data.source=sklearn:diabetes"))  # whole numbers 25..346
    assert prep.params["objective"] == "reg:squarederror"
    assert "whole numbers 25..346, not class indices 0..k-1 as the smallest is 25" in prep.objective.line(prep.metrics)


def test_labels_read_from_a_file_are_counted(tmp_path):
    rng = np.random.default_rng(0)
    cases = {"ratings": ([1, 2, 3, 4, 5], "reg:squarederror", "whole numbers 1..5"),
             "gaps": ([0, 1, 3], "reg:squarederror", "whole numbers 0..3 with gaps: only 3 of the 4 values occur"),
             "classes": ([0, 1, 2, 3], "multi:softprob", "class indices 0..3, 4 classes")}
    for name, (values, objective, words) in cases.items():
        y = np.array(values * 10, dtype=np.int64)
        pq.write_table(pa.table({"x": rng.normal(size=len(y)), "y": y}), tmp_path / f"{name}.parquet")
        prep = prepare(load(f"data.source={tmp_path / name}.parquet", "data.label=y"))
        assert prep.params["objective"] == objective and words in prep.objective.reason, (name, prep.objective)


def test_the_inference_rule():
    assert infer_objective(LabelSummary(0.0, 1.0, True, True, 2))[0] == "binary:logistic"
    assert infer_objective(LabelSummary(0.0, 0.0, True, True, 1))[0] == "binary:logistic"
    assert infer_objective(LabelSummary(0.0, 1.0, True, True, 2), num_class=2)[0] == "multi:softprob"
    many = LabelSummary(0.0, float(MAX_CLASSES), False, True, MAX_CLASSES + 1)
    assert class_count(many) == MAX_CLASSES + 1 and infer_objective(many) == ("reg:squarederror", f"whole numbers 0..{MAX_CLASSES}: more than {MAX_CLASSES} classes, so read as a quantity")
    years = infer_objective(LabelSummary(1990.0, 2024.0, False, True, 35))
    assert years == ("reg:squarederror", "whole numbers 1990..2024, not class indices 0..k-1 as the smallest is 1990")
    assert infer_objective(LabelSummary(-1.0, 1.0, False, True, 3))[0] == "reg:squarederror"
    assert infer_objective(LabelSummary(-1.5, 2.5, False, False))[0] == "reg:squarederror"


def test_num_class_without_an_objective_trains_multiclass():
    prep = prepare(load("data.source=sklearn:breast_cancer", "params.num_class=2"))
    assert prep.params["objective"] == "multi:softprob" and prep.objective.reason == "params.num_class is 2"


def test_a_given_objective_is_kept_and_said_to_be_given():
    prep = prepare(load("data.source=sklearn:iris", "params.objective=reg:squarederror"))
    assert prep.params["objective"] == "reg:squarederror" and not prep.objective.inferred
    assert prep.objective.line(prep.metrics) == "xgboost: objective reg:squarederror (set in params); eval_metric rmse"
    prep = prepare(load("data.source=sklearn:iris", "params.objective=multi:softmax"))
    assert prep.params["num_class"] == 3 and prep.objective.num_class == 3 and not prep.objective.inferred


def test_a_given_objective_that_does_not_fit_the_labels_is_refused():
    msg = refused("data.source=sklearn:iris", "params.objective=binary:logistic")
    assert "params.objective: binary:logistic needs labels in [0, 1], but the labels span [0, 2] (the class indices 0..2: 3 classes)" in msg
    assert "use multi:softprob for 3 classes" in msg
    msg = refused("data.source=synthetic:regression", "params.objective=multi:softprob")
    assert "multi:softprob needs class labels 0..k-1" in msg
