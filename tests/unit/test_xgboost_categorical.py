"""String and named numeric columns as xgboost categories, and columns left out, without Ray."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import xgboost as xgb

from raylane.actors import tabular_files
from raylane.actors.tabular import SourceError, describe, read_rows

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CITIES = ["paris", "oslo", "berlin", "lyon", "madrid"]


def rows(n: int, seed: int, cities: list[str]) -> pa.Table:
    rng = np.random.default_rng(seed)
    city = [cities[i] for i in rng.integers(0, len(cities), n)]
    city = [None if i % 11 == 5 else c for i, c in enumerate(city)]  # some missing
    zone = rng.integers(10, 14, n)
    return pa.table({
        "city": pa.array(city, pa.string()),
        "kind": pa.array([["a", "b"][i % 2] for i in range(n)]).dictionary_encode(),
        "zone": zone,
        "noise": rng.normal(size=n),
        "id": pa.array([f"row-{seed}-{i}" for i in range(n)]),
        "y": pa.array([int(c in ("berlin", "madrid", "paris")) if c else 0 for c in city]),
    })


@pytest.fixture(params=["parquet", "csv"])
def source(request, tmp_path):
    """Two files; 'madrid' appears only in the second, so only a whole-source read knows it."""
    folder = tmp_path / "data"
    folder.mkdir()
    first, second = rows(60, 0, CITIES[:4]), rows(40, 1, CITIES)
    if request.param == "parquet":
        pq.write_table(first, folder / "p0.parquet", row_group_size=16)
        pq.write_table(second, folder / "p1.parquet", row_group_size=16)
    else:
        for name, t in (("p0.csv", first), ("p1.csv", second)):
            pacsv.write_csv(t.set_column(1, "kind", t["kind"].cast(pa.string())), folder / name)
    return str(folder), pa.concat_tables([first, second.cast(first.schema)])


def test_string_columns_are_categories_coded_alike_in_every_row_range(source):
    path, whole = source
    spec, _ = describe(path, label="y", drop=["id"], categorical=["zone"])
    assert spec.features == ("city", "kind", "zone", "noise")
    cats = dict(spec.categories)
    assert cats["city"] == tuple(sorted(CITIES)) and cats["kind"] == ("a", "b")  # over both files, sorted
    assert cats["zone"] == tuple(float(z) for z in sorted(set(whole["zone"].to_pylist())))
    assert spec.feature_types == ["c", "c", "c", "q"]
    x, _ = read_rows(spec, 0, 100)
    for lo, hi in [(0, 37), (37, 61), (61, 100)]:  # any shard codes its rows with the same list
        np.testing.assert_array_equal(read_rows(spec, lo, hi)[0], x[lo:hi])
    city = whole["city"].to_pylist()
    want = [math.nan if c is None else float(sorted(CITIES).index(c)) for c in city]
    np.testing.assert_array_equal(x[:, 0], np.array(want, np.float32))  # a missing value reads as missing (NaN)
    np.testing.assert_array_equal(x[:, 2], [cats["zone"].index(float(z)) for z in whole["zone"].to_pylist()])


def test_xgboost_splits_on_the_categories(source):
    path, whole = source
    spec, _ = describe(path, label="y", drop=["id"])
    x, y = read_rows(spec, 0, spec.rows)
    d = xgb.QuantileDMatrix(x, y, feature_types=spec.feature_types, enable_categorical=True, feature_names=list(spec.features))
    booster = xgb.train({"tree_method": "hist", "max_depth": 1, "eta": 1.0, "objective": "binary:logistic"}, d, 1)
    # One split of depth 1 separates {berlin, madrid, paris} from the rest only as a set of categories.
    pred = booster.predict(d) > 0.5
    assert booster.feature_types[0] == "c" and (pred == (y == 1)).mean() > 0.9


def test_drop_and_categorical_refuse_what_they_cannot_mean(source, monkeypatch):
    path, _ = source
    with pytest.raises(SourceError, match=r"data.drop: unknown columns \['ids'\]; the columns are: city, kind, zone, noise, id, y"):
        describe(path, label="y", drop=["ids"])
    with pytest.raises(SourceError, match="data.drop lists the label column 'y'"):
        describe(path, label="y", drop=["y"])
    with pytest.raises(SourceError, match=r"data.features and data.drop both list \['noise'\]"):
        describe(path, label="y", features=["noise", "zone"], drop=["noise"])
    with pytest.raises(SourceError, match=r"data.categorical: \['id'\] are not feature columns"):
        describe(path, label="y", drop=["id"], categorical=["id"])
    with pytest.raises(SourceError, match="data.categorical applies to file sources"):
        describe("sklearn:iris", categorical=["petal length (cm)"])
    with pytest.raises(SourceError, match="data.drop cannot remove columns of synthetic data"):
        describe("synthetic:classification", rows=10, num_features=3, drop=["f0"])
    monkeypatch.setattr(tabular_files, "MAX_CATEGORIES", 50)
    with pytest.raises(SourceError, match=r"column 'id' .* has 100 distinct values; more than 50 categories is more likely an id .* data.drop=\['id'\]"):
        describe(path, label="y")


def test_drop_leaves_sklearn_columns_out():
    spec, _ = describe("sklearn:iris", drop=["sepal width (cm)"])
    assert "sepal width (cm)" not in spec.features and len(spec.features) == 3
    assert read_rows(spec, 0, 5)[0].shape == (5, 3)
