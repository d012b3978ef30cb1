"""A user's click table for ps_ctr, without Ray: the schema read as the user meant it,
stable hashing, each worker's own row range, and bad tables refused naming the column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctr_tables import write_clicks  # tests/ctr_tables.py
from raylane import config as cfg
from raylane.actors.ctr_files import NULL_TOKEN, _bucket, describe_ctr, hash_values, read_ctr_rows, read_out
from raylane.actors.tabular import SourceError

from prepared import config, inputs  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture
def clicks(tmp_path):
    return write_clicks(tmp_path / "clicks", 5_000)


def test_strings_are_fields_numbers_are_features_and_the_label_is_checked(clicks):
    t = describe_ctr(str(clicks), label="clicked")
    assert t.categorical == ("site0", "site1", "site2", "site3") and t.numeric == ("n0", "n1", "n2") and t.spec.rows == 5_000
    named = describe_ctr(str(clicks), label="clicked", categorical=["site1", "site0"], numeric=["n2"])
    assert named.categorical == ("site1", "site0") and named.numeric == ("n2",)


def test_each_worker_reads_only_its_rows_and_together_they_are_the_table(clicks):
    t = describe_ctr(str(clicks), label="clicked")
    ids, numeric, labels = read_ctr_rows(t, 1_000, 0, 5_000)
    assert ids.shape == (5_000, 4, 1) and numeric.shape == (5_000, 3) and set(np.unique(labels)) == {0.0, 1.0}
    assert ids.min() >= 0 and ids.max() < 1_000
    for lo, hi in [(0, 1_234), (1_234, 2_500), (2_500, 5_000)]:  # across row groups and the file boundary
        part = read_ctr_rows(t, 1_000, lo, hi)
        for a, b in zip(part, (ids[lo:hi], numeric[lo:hi], labels[lo:hi])):
            np.testing.assert_array_equal(a, b)
    assert (numeric[::97, 0] == 0.0).all() and np.count_nonzero(numeric[:, 1]) == 5_000  # a missing number reads as 0
    whole = pq.read_table(clicks)
    assert labels.tolist() == whole["clicked"].to_pylist()


def test_standardised_numbers_have_mean_0_and_sd_1_and_a_missing_cell_reads_as_the_mean(tmp_path):
    folder = write_clicks(tmp_path / "scaled", 5_000)
    raw = pq.read_table(folder)
    raw_n1 = raw["n1"].to_numpy() * 250.0 + 3_000.0  # a price in the thousands
    pq.write_table(raw.set_column(raw.schema.get_field_index("n1"), "n1", pa.array(raw_n1)), folder / "part-0.parquet")
    for extra in folder.glob("part-1.parquet"):
        extra.unlink()
    t = describe_ctr(str(folder), label="clicked", standardize=True)
    _, numeric, labels = read_ctr_rows(t, 1_000, 0, t.spec.rows)
    present = np.ones(len(numeric), bool)
    present[::97] = False
    np.testing.assert_allclose(numeric[present, 0].mean(), 0.0, atol=1e-4)
    np.testing.assert_allclose(numeric[:, 1].mean(), 0.0, atol=1e-4)
    np.testing.assert_allclose(numeric[:, 1].std(), 1.0, atol=1e-4)
    assert (numeric[~present, 0] == 0.0).all()  # missing: the mean
    assert t.positives == int(labels.sum()) and t.scale[1][0] == pytest.approx(raw_n1.mean(), rel=1e-6)
    assert describe_ctr(str(folder), label="clicked").scale == ()  # unasked: read as they are


def test_the_read_out_names_every_columns_role_the_split_and_the_share_clicked(clicks):
    t = describe_ctr(str(clicks), label="clicked", categorical=["site0", "site1"], numeric=["n1"], standardize=True)
    _, _, labels = read_ctr_rows(t, 1_000, 4_000, 5_000)
    held = int(labels.sum())
    line, event = read_out(t, 4_000, 1_000, held)
    assert event["roles"] == {"clicked": "label", "site0": "embedding field", "site1": "embedding field", "n1": "numeric (standardised)",
                              "site2": "not used", "site3": "not used", "n0": "not used", "n2": "not used"}
    assert event["train_clicked"] + event["held_out_clicked"] == t.positives and event["held_out_rows"] == 1_000
    assert "embedding fields site0, site1; numeric n1; not used: site2, site3, n0, n2; 4,000 rows train (" in line
    assert f"the last 1,000 held out ({held / 1_000:.1%} clicked)" in line


def test_hashing_is_stable_and_the_same_for_plain_and_dictionary_strings():
    values = pa.array(["a", "b", None, "a", "zz"])
    h = hash_values(values, 97)
    assert h[0] == h[3] != h[1] and h[2] == _bucket(NULL_TOKEN, 97)
    np.testing.assert_array_equal(h, hash_values(values.dictionary_encode(), 97))
    assert h[1] == _bucket("b", 97)  # a keyed BLAKE2b of the text: the same in every process and run
    ints = hash_values(pa.array([5, 7, 5, None], pa.int64()), 1_000)
    assert ints[0] == ints[2] != ints[1] and ints[3] == _bucket(NULL_TOKEN, 1_000)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.drop_columns(["clicked"]), r"data.label: no column 'clicked' .* its columns are: site0"),
    (lambda t: t.set_column(t.schema.get_field_index("clicked"), "clicked", pa.array([0, 1, 2] * 10, pa.int8())),
     r"data.label: column 'clicked' .* holds 2.0 at row 2; a label is 0 or 1"),
    (lambda t: t.set_column(t.schema.get_field_index("clicked"), "clicked", pa.array([0, None] + [1] * 28, pa.int8())),
     r"holds None at row 1"),
    (lambda t: t.append_column("tags", pa.array([["x"]] * 30)), r"neither numeric nor categorical: tags \(list<"),
    (lambda t: t.select(["n0", "clicked"]), r"no categorical column"),
])
def test_a_table_that_cannot_be_trained_on_is_refused_naming_the_column(tmp_path, change, message):
    base = pq.read_table(write_clicks(tmp_path / "ok", 30, files=1))
    pq.write_table(change(base), tmp_path / "bad.parquet")
    with pytest.raises(SourceError, match=message):
        describe_ctr(str(tmp_path / "bad.parquet"), label="clicked")


def test_the_job_config_refuses_generated_data_keys_and_a_table_too_small(clicks):
    with pytest.raises(cfg.ConfigError, match=r"fields, dense_features describe generated data; with data.path the table decides"):
        config("ps_ctr", f"data.path={clicks}", "data.label=clicked", "fields=3", "dense_features=2")
    with pytest.raises(cfg.ConfigError, match=r"has 5000 rows; eval_rows \(5000\) are held out"):
        config("ps_ctr", f"data.path={clicks}", "data.label=clicked", "eval_rows=5000")
    with pytest.raises(cfg.ConfigError, match=r"data.numeric: column 'site0' .* is string, not a number"):
        config("ps_ctr", f"data.path={clicks}", "data.label=clicked", "data.numeric=[site0]")
    ok, data = inputs("ps_ctr", f"data.path={clicks}", "data.label=clicked", "eval_rows=500")
    t = data.table
    assert ok.shape(t).fields == 4 and ok.shape(t).ids_per_field == 1 and ok.shape(t).dense_features == 3
