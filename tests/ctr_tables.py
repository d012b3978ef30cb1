"""Click tables of a user's own, written as Parquet for the ps_ctr tests: the generated clicks'
ids as strings (one categorical column per field), their numeric features, and the label."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylane.actors import ctr


def write_clicks(folder: Path, rows: int, *, fields: int = 4, numeric: int = 3, files: int = 2, seed: int = 0) -> Path:
    """``rows`` clicks in ``files`` Parquet files (row groups of 2,000) under ``folder``;
    numeric column n0 has a missing value every 97th row. Returns the folder."""
    shape = ctr.CTRShape(fields=fields, ids_per_field=1, buckets=2_000, dense_features=numeric)
    ids, dense, labels = ctr.rows(shape, seed, 0, rows)
    cols = {f"site{f}": pa.array([f"s{f}-{v}" for v in ids[:, f, 0]]) for f in range(fields)}
    for j in range(numeric):
        values = dense[:, j].astype(np.float64)
        cols[f"n{j}"] = pa.array(values, mask=(np.arange(rows) % 97 == 0) if j == 0 else None)
    cols["clicked"] = pa.array(labels.astype(np.int8))
    table = pa.table(cols)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for i in range(files):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), folder / f"part-{i}.parquet", row_group_size=2_000)
    return folder
