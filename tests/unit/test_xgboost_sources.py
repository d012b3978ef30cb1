"""XGBoost data sources, shard splitting and bad input, all without Ray."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import ray
from typer.testing import CliRunner

from raylane import config as cfg
from raylane.actors.tabular import describe, eval_mask, read_rows, synthetic_rows
from raylane.cli import app
from raylane.jobs.xgboost import OBJECTIVES, XGBoostJobConfig, prepare, speed_shards

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "a": rng.normal(size=n),
        "b": rng.integers(0, 5, size=n),
        "flag": rng.random(n) < 0.5,
        "y": (rng.random(n) < 0.4).astype(np.int64),
    })


@pytest.fixture
def parquet_dir(tmp_path):
    """Two files, several row groups each: 70 + 45 rows."""
    folder = tmp_path / "pq"
    folder.mkdir()
    whole = table(115)
    pq.write_table(whole.slice(0, 70), folder / "part-0.parquet", row_group_size=16)
    pq.write_table(whole.slice(70), folder / "part-1.parquet", row_group_size=16)
    (folder / "_SUCCESS").write_text("")  # writers leave markers beside the data
    return folder, whole


def load(**overrides) -> XGBoostJobConfig:
    return config("xgboost", *(f"{k}={v}" for k, v in overrides.items()))


def refused(**overrides) -> str:
    with pytest.raises(cfg.ConfigError) as info:
        load(**overrides)
    return " ".join(str(info.value).split())


def test_synthetic_rows_are_the_same_whichever_range_asks_for_them():
    x, y = synthetic_rows("classification", 7, 5, 0, 50_000)
    for a, b in [(0, 1), (16_383, 16_385), (12_345, 49_999), (40_000, 50_000)]:
        xa, ya = synthetic_rows("classification", 7, 5, a, b)
        assert np.array_equal(xa, x[a:b]) and np.array_equal(ya, y[a:b])
    assert x.dtype == np.float32 and x.flags.c_contiguous
    assert set(np.unique(y)) == {0.0, 1.0} and 0.3 < y.mean() < 0.7
    other, _ = synthetic_rows("classification", 8, 5, 0, 100)
    assert not np.array_equal(other, x[:100])
    xr, yr = synthetic_rows("regression", 7, 5, 0, 1000)
    assert np.isfinite(yr).all() and yr.std() > 0.5


def test_eval_split_holds_out_the_same_rows_however_the_rows_are_sharded():
    whole = eval_mask(3, 0, 100_000, 0.2)
    assert 0.19 < whole.mean() < 0.21
    for shards in ([(0, 100_000)], [(0, 33_333), (33_333, 100_000)], [(0, 1), (1, 70_000), (70_000, 100_000)]):
        assert np.array_equal(np.concatenate([eval_mask(3, a, b, 0.2) for a, b in shards]), whole)
    assert not eval_mask(3, 0, 1000, 0.0).any()
    assert not np.array_equal(eval_mask(4, 0, 1000, 0.2), whole[:1000])


def test_shards_follow_node_speed():
    assert speed_shards(9, [1.0, 2.0]) == [(0, 3), (3, 9)]
    shards = speed_shards(1_000_000, [2.0, 1.0])
    sizes = [b - a for a, b in shards]
    assert shards[0][0] == 0 and shards[-1][1] == 1_000_000 and sizes == [666_667, 333_333]
    with pytest.raises(ValueError, match="leave a shard empty"):
        speed_shards(2, [1.0, 1.0, 1.0])


def test_parquet_folder_rows_are_read_per_range_across_files_and_row_groups(parquet_dir):
    folder, whole = parquet_dir
    spec, labels = describe(str(folder), label="y")
    assert spec.kind == "parquet" and spec.rows == 115 and spec.features == ("a", "b", "flag")
    assert [p.rows for p in spec.files] == [70, 45] and spec.files[0].row_groups == (16, 16, 16, 16, 6)
    assert labels.binary and labels.integral
    expected = np.column_stack([whole[c].to_numpy().astype(np.float32) for c in ("a", "b", "flag")])
    for a, b in [(0, 115), (5, 20), (60, 80), (70, 71), (100, 115), (33, 33)]:
        x, y = read_rows(spec, a, b)
        assert np.array_equal(x, expected[a:b]) and np.array_equal(y, whole["y"].to_numpy()[a:b].astype(np.float32))


def test_csv_file_rows_are_read_per_range(tmp_path):
    whole = table(300, seed=1)
    path = tmp_path / "rows.csv"
    pacsv.write_csv(whole, path)
    spec, _ = describe(str(path), label="y", features=["b", "a"])
    assert spec.kind == "csv" and spec.rows == 300 and spec.features == ("b", "a")
    x, y = read_rows(spec, 120, 260)
    assert np.allclose(x[:, 1], whole["a"].to_numpy()[120:260].astype(np.float32))
    assert np.array_equal(x[:, 0], whole["b"].to_numpy()[120:260].astype(np.float32))
    assert np.array_equal(y, whole["y"].to_numpy()[120:260].astype(np.float32))


def test_sklearn_datasets_ship_with_the_package():
    spec, labels = describe("sklearn:breast_cancer")
    assert spec.rows == 569 and len(spec.features) == 30 and spec.label == "target" and labels.binary
    x, y = read_rows(spec, 100, 110)
    assert x.shape == (10, 30) and set(np.unique(y)) <= {0.0, 1.0}
    spec, labels = describe("sklearn:diabetes")
    assert spec.rows == 442 and not labels.binary


def test_config_settles_params_and_derives_the_driver_steps():
    conf = load(**{"num_boost_round": 100, "checkpoint_every": 30, "data.source": "sklearn:diabetes"})
    assert conf.driver.max_steps == 4 and conf.driver.checkpoint_every_steps == 1
    prep = prepare(conf)
    assert prep.params["objective"] == "reg:squarederror" and prep.metrics == ("rmse",)
    assert prep.evals == ("train", "eval") and prep.quantile
    conf = load(**{"data.source": "sklearn:iris", "params.objective": "multi:softprob", "params.max_depth": 3})
    prep = prepare(conf)
    assert prep.params["num_class"] == 3 and prep.params["max_depth"] == 3 and prep.params["tree_method"] == "hist"
    assert prep.metrics == ("mlogloss", "merror")


def test_missing_label_column_lists_the_columns(parquet_dir):
    folder, _ = parquet_dir
    msg = refused(**{"data.source": str(folder), "data.label": "target"})
    assert "no column 'target'" in msg and "a, b, flag, y" in msg


def test_feature_columns_that_are_neither_numeric_nor_categorical_are_named(tmp_path):
    t = table(20).append_column("seen", pa.array(np.arange(20).astype("datetime64[s]")))
    pq.write_table(t, tmp_path / "t.parquet")
    msg = refused(**{"data.source": str(tmp_path / "t.parquet"), "data.label": "y"})
    assert "neither numeric nor categorical" in msg and "seen (timestamp[ms])" in msg and "data.drop=[...]" in msg
    assert load(**{"data.source": str(tmp_path / "t.parquet"), "data.label": "y", "data.drop": '["seen"]'}).data.drop == ["seen"]


@pytest.mark.parametrize("bad, what", [(math.nan, "NaN or infinite"), (math.inf, "NaN or infinite"), (None, "empty labels")])
def test_bad_labels_are_refused_with_their_row(tmp_path, bad, what):
    t = table(30)
    labels = t["y"].to_pylist()
    labels[17] = bad
    t = t.set_column(3, "y", pa.array([None if v is None else float(v) for v in labels], pa.float64()))
    pq.write_table(t, tmp_path / "t.parquet")
    msg = refused(**{"data.source": str(tmp_path / "t.parquet"), "data.label": "y"})
    assert what in msg and "row 17" in msg


def test_fewer_rows_than_trainers_is_refused(tmp_path):
    pq.write_table(table(3), tmp_path / "t.parquet")
    msg = refused(**{"data.source": str(tmp_path / "t.parquet"), "data.label": "y", "trainers": 4})
    assert "4 trainers need at least as many rows" in msg and "has 3" in msg


@pytest.mark.parametrize("key", ["trainers", "threads", "num_boost_round", "checkpoint_every"])
@pytest.mark.parametrize("value", [0, -2])
def test_zero_or_negative_counts_are_refused(key, value):
    assert f"{key}: must be >= 1, got {value}" in refused(**{key: value})


def test_unknown_objective_lists_the_valid_ones():
    msg = refused(**{"params.objective": "binary:logstic"})
    assert "unknown objective 'binary:logstic'" in msg and "Did you mean 'binary:logistic'?" in msg
    assert all(o in msg for o in OBJECTIVES)


def test_objective_must_fit_the_labels():
    msg = refused(**{"data.source": "sklearn:diabetes", "params.objective": "binary:logistic"})
    assert "needs labels in [0, 1]" in msg and "[25, 346]" in msg


def test_an_evaluation_split_that_holds_out_nothing_is_refused():
    msg = refused(**{"data.source": "sklearn:iris", "data.eval_fraction": 0.0001})
    assert "holds out no rows of the 150" in msg


def test_params_that_have_their_own_field_are_refused():
    assert "params.nthread: set threads instead" in refused(**{"params.nthread": 4})


def test_xgboost_refusing_a_param_is_reported_before_anything_starts():
    msg = refused(**{"params.eval_metric": "[no-such-metric]"})
    assert msg.startswith("params: xgboost refused") and "no-such-metric" in msg


def test_a_file_that_does_not_exist_is_refused(tmp_path):
    msg = refused(**{"data.source": str(tmp_path / "nope.parquet"), "data.label": "y"})
    assert "no such file or folder" in msg and "nope.parquet" in msg


def test_cli_refuses_bad_input_before_ray_starts_and_documents_every_key(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["run", "xgboost", "--set", f"data.source={tmp_path / 'missing.csv'}", "--set", "data.label=y"])
    assert result.exit_code == 2 and "no such file or folder" in " ".join(result.output.split())
    result = runner.invoke(app, ["run", "xgboost", "--set", "trainers=0"])
    assert result.exit_code == 2 and "trainers: must be >= 1, got 0" in result.output
    assert not ray.is_initialized()
    keys = cfg.describe(XGBoostJobConfig)
    assert {"data.source", "params", "num_boost_round", "trainers", "threads", "checkpoint_every", "data.eval_fraction"} <= {k for k, *_ in keys}
    assert all(doc for *_, doc in keys), [k for k, *_, doc in keys if not doc]
    result = runner.invoke(app, ["jobs", "xgboost"])
    assert result.exit_code == 0 and "data.eval_fraction" in result.output


@pytest.mark.parametrize("override, says", [
    ("driver.max_steps=3", r"driver.max_steps=3 does not apply to xgboost: it is 5 here .*set num_boost_round"),
    ("driver.checkpoint_every_steps=4", r"driver.checkpoint_every_steps=4 does not apply to xgboost: it is 1 here .*set checkpoint_every"),
])
def test_a_driver_setting_that_xgboost_derives_is_refused_not_overwritten(override, says):
    from raylane import config as cfg

    base = ["data.source=synthetic:classification", "data.rows=2000", "num_boost_round=50", "checkpoint_every=10"]
    with pytest.raises(cfg.ConfigError, match=says):
        config("xgboost", *base, override)
    conf = config("xgboost", *base)
    assert conf.driver.max_steps == 5 and conf.driver.checkpoint_every_steps == 1
