"""Data that would train without a word and give a meaningless model: infinite feature cells,
labels with skipped or single classes, a constant label under a classification objective.
Each is refused naming the column, the bad values and rows, and what to change; a missing
cell, where the docs say it reads as 0, is counted instead. No Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_tables import write_clicks  # tests/ctr_tables.py
from fed_tables import write_clients  # tests/fed_tables.py
from raylane import config as cfg
from raylane.actors.ctr_files import describe_ctr, read_ctr_rows
from raylane.actors.fed_data import FedDataConfig, describe_table, load
from raylane.actors.tabular import SourceError, describe, read_rows
from raylane.jobs.federated import FederatedConfig

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------- ps_ctr


def clicks_with(tmp_path, column: str, rows: dict[int, float]):
    """The test clicks in one file, with ``rows`` of ``column`` set to the given values."""
    folder = write_clicks(tmp_path / "c", 3_000, files=1)
    t = pq.read_table(folder / "part-0.parquet")
    values = t.column(column).to_numpy(zero_copy_only=False).copy()
    for r, v in rows.items():
        values[r] = v
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(values, mask=np.isnan(values)))
    pq.write_table(t, folder / "part-0.parquet")
    return folder


def test_ctr_infinite_numeric_cells_are_refused_before_ray_starts_naming_column_count_and_rows(tmp_path):
    folder = clicks_with(tmp_path, "n1", {5: np.inf, 40: -np.inf, 2_500: 1e300})  # 1e300 is infinite as float32
    with pytest.raises(SourceError) as info:
        describe_ctr(str(folder), label="clicked")
    said = one_line(info.value)
    assert "data.numeric" in said and "column 'n1' holds 3 (first at rows 5, 40, 2500)" in said
    assert "replace those cells with a finite value or leave them empty" in said
    with pytest.raises(cfg.ConfigError, match=r"column 'n1' holds 3"):  # the job's config check, before any actor
        config("ps_ctr", f"data.path={folder}", "data.label=clicked", "eval_rows=500")


def test_ctr_missing_numeric_cells_still_read_as_0_and_are_counted(tmp_path):
    folder = write_clicks(tmp_path / "c", 3_000, files=2)  # n0 is missing every 97th row
    t = describe_ctr(str(folder), label="clicked")
    assert dict(t.missing) == {"n0": len(range(0, 3_000, 97))}
    _, numeric, _ = read_ctr_rows(t, 1_000, 0, 3_000)
    assert np.isfinite(numeric).all() and (numeric[::97, 0] == 0).all()


# ---------------------------------------------------------------- federated


def fed_conf(path, *overrides: str) -> FederatedConfig:
    return config("federated", f"data.path={path}", "data.label=digit", "data.client_column=site", *overrides)


def digits_with(tmp_path, change) -> str:
    folder = write_clients(tmp_path / "t", clients=4, files=1)
    t = pq.read_table(folder / "part-0.parquet")
    t = change(t)
    pq.write_table(t, folder / "part-0.parquet")
    return folder


def set_rows(t: pa.Table, column: str, rows: dict[int, float]) -> pa.Table:
    values = t.column(column).to_numpy(zero_copy_only=False).copy()
    for r, v in rows.items():
        values[r] = v
    kind = t.schema.field(column).type
    return t.set_column(t.schema.get_field_index(column), column, pa.array(values, type=kind, mask=np.isnan(values) if values.dtype.kind == "f" else None))


def test_fed_infinite_feature_is_refused_naming_column_and_rows(tmp_path):
    folder = digits_with(tmp_path, lambda t: set_rows(t, "p3", {7: np.inf, 8: -np.inf}))
    with pytest.raises(cfg.ConfigError) as info:
        fed_conf(folder)
    said = one_line(info.value)
    assert "data.features" in said and "column 'p3' holds 2 (first at rows 7, 8)" in said and "leave them empty" in said


def test_fed_missing_features_read_as_0_and_are_counted(tmp_path):
    folder = write_clients(tmp_path / "t", clients=4)
    table = describe_table(FedDataConfig(path=str(folder), label="digit", client_column="site"))
    assert dict(table.missing) == {"p0": len(range(0, 1797, 101))}


def test_fed_a_stray_label_is_refused_naming_the_value_its_rows_and_to_recode(tmp_path):
    # digits are 0..9; one 17 would make 18 classes, seven of them empty (10..16)
    folder = digits_with(tmp_path, lambda t: set_rows(t, "digit", {12: 17}))
    with pytest.raises(cfg.ConfigError) as info:
        fed_conf(folder)
    said = one_line(info.value)
    assert "data.label 'digit'" in said and "must hold the class indices 0..k-1 with none skipped" in said
    assert "outside 0..10: 17 on 1 row (first at rows 12)" in said and "(7 of 0..17 never occur: 10, 11, 12, 13, 14, ...)" in said
    assert "recode the labels as 0..10" in said


def test_fed_labels_0_1_2_and_7_are_refused(tmp_path):
    y = np.array([0, 1, 2] * 10 + [7], dtype=np.int64)
    pq.write_table(pa.table({"site": ["a", "b"] * 15 + ["a"], "x": np.arange(31.0), "digit": y}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match=r"its 4 classes go up to 7 \(4 of 0..7 never occur: 3, 4, 5, 6\); outside 0..3: 7 on 1 row \(first at rows 30\)"):
        describe_table(FedDataConfig(path=str(tmp_path / "t.parquet"), label="digit", client_column="site"))


def test_fed_a_single_class_is_refused(tmp_path):
    pq.write_table(pa.table({"site": ["a", "b"] * 5, "x": np.arange(10.0), "digit": [3] * 10}), tmp_path / "t.parquet")
    with pytest.raises(cfg.ConfigError, match=r"data.label 'digit' .* holds one class only \(3, all 10 rows\): there is nothing to classify"):
        fed_conf(tmp_path / "t.parquet", "clients_per_round=2")


def test_fed_labels_that_are_0_to_k_minus_1_still_load(tmp_path):
    source = fed_conf(write_clients(tmp_path / "t", clients=4), "clients_per_round=2").source()
    assert source.table.classes == 10 and load(source).classes == 10


# ---------------------------------------------------------------- xgboost


def xgb_refused(*overrides: str) -> str:
    with pytest.raises(cfg.ConfigError) as info:
        config("xgboost", *overrides)
    return one_line(info.value)


@pytest.mark.parametrize("value, params", [(0, []), (1, []), (1, ["params.objective=binary:logistic"]),
                                           (2, ["params.objective=multi:softprob"]), (0, ["params.num_class=3"])])
def test_xgboost_a_constant_label_is_not_classified(tmp_path, value, params):
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.normal(size=200), "y": np.full(200, value, dtype=np.int64)}), tmp_path / "t.parquet")
    said = xgb_refused(f"data.source={tmp_path / 't.parquet'}", "data.label=y", *params)
    assert f"data.label: column 'y' holds one value only ({value}, every row)" in said
    assert "nothing to classify and the eval AUC would be NaN" in said and "reg:squarederror" in said


def test_xgboost_a_constant_label_may_still_be_regressed(tmp_path):
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.normal(size=200), "y": np.zeros(200)}), tmp_path / "t.parquet")
    c = config("xgboost", f"data.source={tmp_path / 't.parquet'}", "data.label=y", "params.objective=reg:squarederror")
    assert c.params["objective"] == "reg:squarederror"


def test_xgboost_an_infinite_feature_is_refused_on_the_trainers_read_naming_column_and_rows(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=100), rng.normal(size=100)
    a[[10, 61]] = [np.inf, -np.inf]
    b[3] = np.nan  # missing for xgboost: fine
    pq.write_table(pa.table({"a": a, "b": b, "zone": ["x", "y"] * 50, "y": (rng.random(100) < 0.5).astype(np.int64)}), tmp_path / "t.parquet")
    spec, _ = describe(str(tmp_path / "t.parquet"), label="y")
    x, _ = read_rows(spec, 0, 10)  # a shard without the bad rows reads
    assert np.isnan(x[3, 1])
    with pytest.raises(SourceError) as info:
        read_rows(spec, 50, 100)
    said = one_line(info.value)
    assert said.startswith("data.features: infinite values") and "rows [50, 100) (this trainer's shard)" in said
    assert "column 'a' holds 1 (first at rows 61)" in said and "data.drop=['a']" in said and "\n" not in str(info.value)
