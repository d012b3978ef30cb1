"""The rows of a federated run and whose they are: scikit-learn's digits split over
logical clients (IID or Dirichlet label skew), or the user's own table with a client-id
column. The server and every client actor call :func:`load` on the same small
:class:`FedSource`, so each reads the data itself and all agree on every client's rows and
the server's held-out rows without the driver shipping any.

A table is checked on the driver before any actor starts (:func:`describe_table`): the
client-id and label columns exist, the label is a class index 0..k-1 with none missing and
none skipped (two classes at least), the features are numeric and finite (a missing cell
reads as 0 and is counted; an infinite one is refused). Each client keeps ``1 - test_fraction`` of its rows (at least one);
the rest, drawn per client from the seed, are the server's held-out set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raylane import config as cfg
from raylane.actors.fed_math import partition
from raylane.actors.tabular import FilePart, SourceError
from raylane.actors.tabular_files import CellTally, filesystem, float32_cells, is_numeric, list_files, read_file_columns, schema_and_parts, show_rows

DIGITS_CLIENTS = 20
"""Logical clients of the digits split when ``clients`` is not given."""


@dataclass
class FedDataConfig:
    """Your table of examples, one row each, with a column saying which client holds it;
    without a path the job splits scikit-learn's digits over ``clients``."""

    path: str | None = None
    """A Parquet (or CSV) file or folder, local or any pyarrow URI (s3://, gs://); null: digits."""
    client_column: str = "client"
    """The column naming the client a row belongs to (any type; one client per distinct value)."""
    label: str = "label"
    """The class column: integers 0..k-1, none missing, none skipped, two classes at least."""
    features: list[str] = cfg.field([])
    """Numeric feature columns (a missing value reads as 0). Empty: every numeric column
    but the client id and the label."""
    format: str = cfg.field("auto", choices=("auto", "parquet", "csv"))
    """File format; auto reads it from the extension (.parquet, .pq, .csv)."""


@dataclass(frozen=True)
class FedTable:
    """The user's table as checked on the driver. Small and picklable."""

    path: str
    """The file or folder as the user gave it."""
    fmt: str
    """``parquet`` or ``csv``."""
    parts: tuple[FilePart, ...]
    """The data files with their row counts, in read order."""
    client_column: str
    """The client-id column."""
    label: str
    """The class column."""
    features: tuple[str, ...]
    """The numeric feature columns, in the order of the matrix columns."""
    client_ids: tuple
    """The distinct client ids, sorted; logical client k is ``client_ids[k]``."""
    client_rows: tuple[int, ...]
    """Rows of each client, in ``client_ids`` order."""
    classes: int
    """Classes: the largest label plus one (every index below it occurs)."""
    missing: tuple[tuple[str, int], ...] = ()
    """(feature, its missing cells, read as 0) for the features that have any."""

    def held_out(self, fraction: float) -> int:
        """Rows :func:`hold_out` keeps for the server; a table that leaves none is refused."""
        n = sum(min(rows - 1, int(fraction * rows)) for rows in self.client_rows)
        if not n:
            raise SourceError(f"test_fraction={fraction} holds out no rows of {self.path!r} for the server's evaluation "
                              "(each client keeps at least one row): raise test_fraction or give more rows")
        return n


@dataclass(frozen=True)
class FedSource:
    """Everything needed to read the same split anywhere."""

    seed: int
    """Seed of the digits split and of each client's held-out rows."""
    test_fraction: float
    """Share of the rows held out for the server."""
    clients: int = DIGITS_CLIENTS
    """Digits: logical clients to split over. A table: its number of client ids."""
    alpha: float | None = None
    """Digits: Dirichlet label skew, None for IID."""
    table: FedTable | None = None
    """The user's table; None: digits."""


@dataclass
class FedData:
    """Training rows with each client's indices into them, and the server's held-out rows."""

    x: np.ndarray
    """Training features (float32), every client's rows."""
    y: np.ndarray
    """Training labels (int64)."""
    parts: list[np.ndarray]
    """Client k's rows: indices into ``x`` and ``y``."""
    test_x: np.ndarray
    """The server's held-out features."""
    test_y: np.ndarray
    """The server's held-out labels."""
    classes: int
    """Classes of the label."""


def load_digits_split(seed: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled handwritten digits (8x8, scaled to [0, 1]): train x, y, test x, y."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng([seed, 3]).permutation(len(y))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)
    n_test = max(1, int(round(len(y) * test_fraction)))
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def load(source: FedSource) -> FedData:
    if source.table is None:
        x, y, tx, ty = load_digits_split(source.seed, source.test_fraction)
        return FedData(x, y, partition(y, source.clients, source.alpha, source.seed), tx, ty, 10)
    source.table.held_out(source.test_fraction)
    x, y, owner = read_table(source.table)
    train, test = hold_out([np.flatnonzero(owner == k) for k in range(len(source.table.client_ids))], source.test_fraction, source.seed)
    starts = np.cumsum([0] + [len(t) for t in train])
    parts = [np.arange(starts[k], starts[k + 1]) for k in range(len(train))]
    rows = np.concatenate(train)
    return FedData(x[rows], y[rows], parts, x[test], y[test], source.table.classes)


def hold_out(client_rows: Sequence[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Each client's training rows and the held-out rows of all: ``floor(fraction * n)`` of a
    client's ``n`` rows, at most ``n - 1``, drawn from ``(seed, client)``."""
    train, test = [], []
    for k, rows in enumerate(client_rows):
        n_test = min(len(rows) - 1, int(fraction * len(rows)))
        pick = np.zeros(len(rows), dtype=bool)
        pick[np.random.default_rng([seed, 5, k]).choice(len(rows), size=max(n_test, 0), replace=False)] = True
        train.append(rows[~pick])
        test.append(rows[pick])
    return train, np.sort(np.concatenate(test)) if test else np.zeros(0, dtype=np.int64)


def describe_table(d: FedDataConfig) -> FedTable:
    """Check the user's table on the driver: its columns, labels and client ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    assert d.path is not None
    fmt, files = list_files(d.path, d.format)
    schema, parts = schema_and_parts(d.path, fmt, files)
    names = list(schema.names)
    for key, col in (("data.client_column", d.client_column), ("data.label", d.label)):
        if col not in names:
            raise SourceError(f"{key}: no column {col!r} in {d.path!r}; its columns are: {', '.join(names)}")
    if d.client_column == d.label:
        raise SourceError(f"data.client_column and data.label are both {d.label!r}; name two different columns")
    unknown = [c for c in d.features if c not in names]
    if unknown:
        raise SourceError(f"data.features: unknown columns {unknown}; the columns are: {', '.join(names)}")
    taken = {d.client_column, d.label}
    if taken & set(d.features):
        raise SourceError(f"data.features lists {sorted(taken & set(d.features))}, the client id or the label; leave them out")
    features = list(d.features) or [n for n in names if n not in taken and is_numeric(schema.field(n).type)]
    bad = [f"{n} ({schema.field(n).type})" for n in features if not is_numeric(schema.field(n).type)]
    if bad:
        raise SourceError(f"data.features must be numeric; not numeric: {', '.join(bad)}")
    if not features:
        raise SourceError(f"{d.path!r} has no numeric feature columns besides {d.client_column!r} and {d.label!r}; its columns are: {', '.join(names)}")
    if not pa.types.is_integer(schema.field(d.label).type):
        raise SourceError(f"data.label {d.label!r} is {schema.field(d.label).type}; it must hold integer class indices 0..k-1")
    fs, _ = filesystem(d.path)
    clients, labels, counted = [], [], []
    # The features are read here too: a missing cell is meant (it reads as 0, counted for the
    # run's read-out), an infinite one is not, and the clients would train on it silently.
    tally, at = CellTally(features), 0
    for part in parts:
        t = read_file_columns(fs, part, fmt, [d.client_column, d.label, *features])
        clients.append(t.column(d.client_column))
        labels.append(t.column(d.label))
        for f in features:
            tally.add(f, float32_cells(t.column(f)), at)
        counted.append(FilePart(part.path, t.num_rows, part.row_groups))
        at += t.num_rows
    tally.refuse_infinite("data.features", d.path, "", "a missing value reads as 0, an infinite one has no meaning: replace those cells "
                          "with a finite value or leave them empty, or leave the column out (name the columns to use in data.features)")
    client = pa.chunked_array([c for a in clients for c in a.chunks], type=schema.field(d.client_column).type)
    label = pa.chunked_array([c for a in labels for c in a.chunks], type=schema.field(d.label).type)
    if label.null_count or client.null_count:
        col = d.label if label.null_count else d.client_column
        raise SourceError(f"column {col!r} of {d.path!r} has {(label if col == d.label else client).null_count} missing values; every row needs one")
    if len(label) == 0:
        raise SourceError(f"{d.path!r} has no rows")
    low = pc.min(label).as_py()
    if low < 0:
        raise SourceError(f"data.label {d.label!r} holds {low}; class indices are 0..k-1")
    classes = check_classes(label.to_numpy(), d.label, d.path)
    counts = pc.value_counts(client).to_pylist()
    rows = dict((c["values"], c["counts"]) for c in counts)
    ids = tuple(sorted(rows))
    return FedTable(d.path, fmt, tuple(counted), d.client_column, d.label, tuple(features), ids, tuple(rows[i] for i in ids), classes,
                    tuple(tally.missing_counts().items()))


def check_classes(y: np.ndarray, label: str, path: str) -> int:
    """k, when the labels ``y`` (whole numbers >= 0, in row order) are exactly the class
    indices 0..k-1 with k >= 2. A skipped index would be a class the model keeps an output
    for but never sees (one stray 7 among 0..2 makes eight classes, five of them empty)."""
    values, counts = np.unique(y, return_counts=True)
    if len(values) < 2:
        raise SourceError(f"data.label {label!r} of {path!r} holds one class only ({values[0]}, all {len(y)} rows): there is nothing to "
                          "classify; give rows of at least two classes, or name another column in data.label")
    k = len(values)
    if values[-1] == k - 1:
        return k
    stray = [(int(v), int(n)) for v, n in zip(values, counts) if v >= k]
    present, never, i = {int(v) for v in values}, [], 0
    while len(never) < 6 and i < values[-1]:  # the first few skipped indices: at most k + 6 steps, however large the labels
        if i not in present:
            never.append(i)
        i += 1
    skipped = int(values[-1]) + 1 - k
    shown = "; ".join(f"{v} on {n} row{'s' if n > 1 else ''} (first at rows {show_rows(np.flatnonzero(y == v))})" for v, n in stray[:10])
    more = f"; and {len(stray) - 10} more values" if len(stray) > 10 else ""
    raise SourceError(f"data.label {label!r} of {path!r} must hold the class indices 0..k-1 with none skipped, but its {k} classes "
                      f"go up to {int(values[-1])} ({skipped} of 0..{int(values[-1])} never occur: {show_rows(np.array(never))}); outside 0..{k - 1}: {shown}{more}; "
                      f"recode the labels as 0..{k - 1}, or drop the stray rows")


def read_table(table: FedTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row's features (float32, missing as 0), label, and client index, in file order."""
    fs, _ = filesystem(table.path)
    index = {v: k for k, v in enumerate(table.client_ids)}
    xs, ys, owners = [], [], []
    for part in table.parts:
        t = read_file_columns(fs, part, table.fmt, [*table.features, table.label, table.client_column])
        xs.append(np.stack([float32_cells(t.column(f)) for f in table.features], axis=1))
        ys.append(t.column(table.label).to_numpy(zero_copy_only=False).astype(np.int64))
        owners.append(np.array([index[v] for v in t.column(table.client_column).to_pylist()], dtype=np.int64))
    x = np.concatenate(xs)
    x[np.isnan(x)] = 0.0  # missing reads as 0; np.nan_to_num would also turn an infinity into float32's largest number
    return x, np.concatenate(ys), np.concatenate(owners)
