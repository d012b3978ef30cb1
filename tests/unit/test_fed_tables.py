"""A user's own client table for ``federated``, without Ray: client ids from a column, each
client's rows and the server's held-out rows the same in every process, and every bad
table refused before Ray starts naming the column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylane import config as cfg
from raylane.actors.fed_data import FedDataConfig, describe_table, hold_out, load
from raylane.jobs.federated import FederatedConfig

from prepared import config  # tests/prepared.py

from fed_tables import write_clients  # tests/fed_tables.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def conf(path, *overrides: str) -> FederatedConfig:
    return config("federated", f"data.path={path}", "data.label=digit", "data.client_column=site", *overrides)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_clients_come_from_the_column_and_every_row_is_trained_or_held_out_once(tmp_path, fmt):
    folder = write_clients(tmp_path / "t", clients=8, fmt=fmt)
    source = conf(folder).source()
    table = source.table
    assert table.client_ids == tuple(f"site-{k:02d}" for k in range(8)) and source.clients == 8
    assert table.classes == 10 and table.features == tuple(f"p{j}" for j in range(64))
    a, b = load(source), load(source)
    assert all(np.array_equal(p, q) for p, q in zip(a.parts, b.parts)) and np.array_equal(a.test_y, b.test_y)
    assert len(a.y) + len(a.test_y) == 1797
    assert np.array_equal(np.sort(np.concatenate(a.parts)), np.arange(len(a.y)))  # every training row in one client
    assert not np.isnan(a.x).any() and not np.isnan(a.test_x).any()  # the missing p0 values read as 0
    assert sum(table.client_rows) == 1797
    # Each client holds out floor(0.2 n) of its own n rows (at most n - 1) for the server.
    assert [len(p) for p in a.parts] == [n - min(n - 1, int(0.2 * n)) for n in table.client_rows]
    assert len(a.test_y) == table.held_out(0.2)


def test_each_client_keeps_at_least_one_row_and_holds_out_its_share():
    rows = [np.arange(0, 1), np.arange(1, 3), np.arange(3, 13)]
    train, test = hold_out(rows, 0.5, seed=0)
    assert [len(t) for t in train] == [1, 1, 5] and len(test) == 6
    assert np.array_equal(np.sort(np.concatenate([*train, test])), np.arange(13))
    assert np.array_equal(hold_out(rows, 0.5, seed=0)[1], test) and not np.array_equal(hold_out(rows, 0.5, seed=1)[1], test)


def test_a_table_of_one_row_per_client_holds_nothing_out_and_says_so(tmp_path):
    pq.write_table(pa.table({"site": ["a", "b", "c"], "x": [0.1, 0.2, 0.3], "digit": [0, 1, 0]}), tmp_path / "t.parquet")
    with pytest.raises(cfg.ConfigError, match=r"test_fraction=0.2 holds out no rows .* raise test_fraction or give more rows"):
        conf(tmp_path / "t.parquet", "clients_per_round=2")


@pytest.mark.parametrize("table, overrides, message", [
    ({"who": ["a"], "x": [1.0], "digit": [0]}, [], r"data.client_column: no column 'site' in .*; its columns are: who, x, digit"),
    ({"site": ["a"], "x": [1.0], "y": [0]}, [], r"data.label: no column 'digit'"),
    ({"site": ["a"], "x": [1.0], "digit": [0.5]}, [], r"data.label 'digit' is double; it must hold integer class indices 0..k-1"),
    ({"site": ["a", "b"], "x": [1.0, 2.0], "digit": [0, -1]}, [], r"data.label 'digit' holds -1; class indices are 0..k-1"),
    ({"site": ["a", "b"], "x": [1.0, 2.0], "digit": pa.array([0, None], pa.int64())}, [], r"column 'digit' .* has 1 missing values"),
    ({"site": ["a", None], "x": [1.0, 2.0], "digit": [0, 1]}, [], r"column 'site' .* has 1 missing values"),
    ({"site": ["a"], "x": [1.0], "when": ["monday"], "digit": [0]}, ["data.features=[x,when]"], r"data.features must be numeric; not numeric: when \(string\)"),
    ({"site": ["a"], "x": [1.0], "digit": [0]}, ["data.features=[x,nope]"], r"data.features: unknown columns \['nope'\]"),
    ({"site": ["a"], "name": ["z"], "digit": [0]}, [], r"no numeric feature columns besides 'site' and 'digit'"),
    ({"site": ["a", "b"], "x": [1.0, 2.0], "digit": [0, 1]}, ["clients=3"], r"clients=3, but column 'site' of .* names 2 clients: drop clients"),
    ({"site": ["a", "b"], "x": [1.0, 2.0], "digit": [0, 1]}, ["alpha=0.1"], r"alpha=0.1 skews the digits split; with data.path the column 'site' says whose each row is"),
    ({"site": ["a", "a", "b", "b"], "x": [1.0, 2.0, 3.0, 4.0], "digit": [0, 1, 0, 1]}, ["test_fraction=0.5"], r"clients_per_round \(5\) cannot exceed clients \(2\)"),
])
def test_a_bad_client_table_is_refused_before_ray_starts_naming_the_column(tmp_path, table, overrides, message):
    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    with pytest.raises(cfg.ConfigError, match=message):
        conf(tmp_path / "t.parquet", *overrides)


def test_a_missing_path_says_what_to_give(tmp_path):
    with pytest.raises(cfg.ConfigError, match=r"no such file or folder"):
        conf(tmp_path / "nope.parquet")
    assert describe_table(FedDataConfig(path=str(write_clients(tmp_path / "ok", clients=3)), label="digit", client_column="site")).classes == 10
