"""Client tables of a user's own for the federated tests: scikit-learn's digits with a
string client-id column (each client a label-skewed share of the rows), as Parquet or CSV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from sklearn.datasets import load_digits

from raylane.actors.fed_math import partition


def write_clients(folder: Path, *, clients: int = 8, alpha: float | None = 0.5, files: int = 2, fmt: str = "parquet", seed: int = 0) -> Path:
    """The digits' 1,797 rows in ``files`` files under ``folder``: 64 pixel columns p0..p63
    (one missing value every 101st row of p0), ``digit`` (the label) and ``site`` (the
    client: 'site-00'...). Rows are shuffled, so a client's rows lie in every file."""
    x, y = load_digits(return_X_y=True)
    owner = np.empty(len(y), dtype=np.int64)
    for k, rows in enumerate(partition(y, clients, alpha, seed)):
        owner[rows] = k
    order = np.random.default_rng(seed).permutation(len(y))
    x, y, owner = x[order] / 16.0, y[order], owner[order]
    cols = {f"p{j}": pa.array(x[:, j], mask=(np.arange(len(y)) % 101 == 0) if j == 0 else None) for j in range(x.shape[1])}
    cols["digit"] = pa.array(y.astype(np.int16))
    cols["site"] = pa.array([f"site-{k:02d}" for k in owner])
    table = pa.table(cols)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(y), files + 1).astype(int)
    for i in range(files):
        part = table.slice(bounds[i], bounds[i + 1] - bounds[i])
        if fmt == "parquet":
            pq.write_table(part, folder / f"part-{i}.parquet")
        else:
            pacsv.write_csv(part, folder / f"part-{i}.csv")
    return folder
