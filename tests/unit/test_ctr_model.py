"""ps_ctr's exported model on rows as a user has them (no Ray): integer ids hashed as the run
hashed them, whether they come as Parquet integers, CSV text, or pandas floats with gaps."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from raylane.actors import ctr
from raylane.actors.ctr_files import hash_values
from raylane.actors.ctr_model import CTRModel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SHAPE = ctr.CTRShape(fields=2, ids_per_field=1, buckets=50, dense_features=1, embedding_dim=4, hidden=8)


def model(hashed_as):
    m = CTRModel(SHAPE, {"categorical": ["user", "site"], "numeric": ["price"], "scale": [[10.0, 2.0]], "label": "clicked", "hashed_as": hashed_as})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m.eval()


def expected(m, users, sites, price):
    ids = np.stack([hash_values(users, 50), hash_values(sites, 50)], axis=1)[:, :, None]
    numeric = ((np.asarray(price, np.float32) - 10.0) / 2.0)[:, None]
    numeric[np.isnan(numeric)] = 0.0
    with torch.no_grad():
        return torch.sigmoid(m(ids, numeric)).numpy()


def test_integer_ids_from_parquet_match_the_same_ids_as_pandas_floats_with_a_gap():
    m = model(["int", "string"])
    users, sites = pa.array([3, None, 7], pa.int64()), pa.array(["a", "b", None])
    want = expected(m, users, sites, [9.0, 11.0, np.nan])
    got_arrow = m.predict(pa.table({"user": users, "site": sites, "price": [9.0, 11.0, None], "other": [1, 2, 3]}))
    got_pandas = m.predict(pd.DataFrame({"user": [3.0, np.nan, 7.0], "site": ["a", "b", None], "price": [9.0, 11.0, np.nan]}))
    np.testing.assert_array_equal(got_arrow, want)
    np.testing.assert_array_equal(got_pandas, want)


def test_ids_a_csv_run_read_as_text_are_hashed_as_text_whatever_type_they_come_in():
    m = model(["string", "string"])
    want = expected(m, pa.array(["3", "7"]), pa.array(["a", "b"]), [9.0, 11.0])
    np.testing.assert_array_equal(m.predict({"user": [3, 7], "site": ["a", "b"], "price": [9.0, 11.0]}), want)


def test_rows_lacking_a_column_or_holding_fractional_ids_are_refused():
    m = model(["int", "string"])
    with pytest.raises(ValueError, match=r"rows lack the columns \['price'\]; the model reads \['user', 'site', 'price'\]"):
        m.predict({"user": [1], "site": ["a"]})
    with pytest.raises(ValueError, match=r"column 'user' holds numbers that are not whole ids"):
        m.predict({"user": [1.5], "site": ["a"], "price": [1.0]})
