"""Click logs of the user's own for the CTR model: a Parquet (or CSV) file or folder on any
``pyarrow.fs`` filesystem with categorical columns, numeric columns and a 0/1 label.

The driver checks the schema, reads the label column (every label 0 or 1, none missing) and
the numeric columns (a missing cell reads as 0 and is counted; an infinite one is refused)
before any actor starts; each worker then reads only its own row range
(:func:`raylane.actors.tabular_files.range_tables`). A categorical column is one field of the
model: its value is hashed into ``[0, buckets)`` with a keyed BLAKE2b of its text (strings) or
splitmix64 (integers), the same in every process and run, unlike Python's ``hash``. Hashed by
hand because the hash must be stable across processes and pyarrow has no public one; only a
batch's distinct values are hashed, so the cost is per distinct value, not per row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raylane import config as cfg

from raylane.actors.ps_layout import _mix
from raylane.actors.tabular import FilePart, SourceError, TableSpec
from raylane.actors.tabular_files import CellTally, filesystem, float32_cells, is_categorical, is_numeric, list_files, range_tables, read_file_columns, schema_and_parts


@dataclass
class CTRDataConfig:
    """Your click table; without a path the job trains on generated clicks."""

    path: str | None = None
    """A Parquet (or CSV) file or folder, local or any pyarrow URI (s3://, gs://, hdfs://); null: generated data."""
    label: str = "label"
    """The 0/1 label column (clicked or not)."""
    categorical: list[str] = cfg.field([])
    """Columns hashed into one embedding table each (strings or integers). Empty: every string column."""
    numeric: list[str] = cfg.field([])
    """Numeric feature columns (a missing value reads as 0, or as the mean with ``standardize``). Empty: every number not in categorical."""
    format: str = cfg.field("auto", choices=("auto", "parquet", "csv"))
    """File format; auto reads it from the extension (.parquet, .pq, .csv)."""
    standardize: bool = True
    """Read each numeric column scaled to mean 0 and standard deviation 1 (a missing cell as
    its mean): a price in the thousands next to a 0/1 flag otherwise swamps the MLP's first
    layer. The statistics are taken when the table is checked, over every row (no labels)."""


NULL_TOKEN = "\x00null"
"""What a missing categorical value hashes as (its own bucket, not 0)."""


@dataclass(frozen=True)
class CTRTable:
    """What a worker needs to read its rows of the user's click table. Small and picklable."""

    spec: TableSpec
    """The files, their row counts, the label; ``spec.features`` is categorical then numeric."""
    categorical: tuple[str, ...]
    """Columns hashed into one embedding table each, in field order."""
    numeric: tuple[str, ...]
    """Columns read as numeric features (a missing value reads as 0)."""
    missing: tuple[tuple[str, int], ...] = ()
    """(numeric column, its missing cells, read as 0) for the columns that have any."""
    positives: int = 0
    """Rows labelled 1 (clicked), over the whole table."""
    columns: tuple[str, ...] = ()
    """Every column of the table, used or not."""
    hashed_as: tuple[str, ...] = ()
    """How each categorical column's values are hashed: ``int`` (a Parquet integer column) or
    ``string`` (text, and every CSV column, read as text)."""
    scale: tuple[tuple[float, float], ...] = ()
    """(mean, standard deviation) of each numeric column over its present cells: rows are read
    as ``(x - mean) / sd``, a missing cell as 0 (the mean). Empty: read as they are."""


def describe_ctr(path: str, *, label: str, categorical: Sequence[str] = (), numeric: Sequence[str] = (), fmt: str = "auto",
                 standardize: bool = False) -> CTRTable:
    """Check a click table's schema and labels on the driver. With neither list given,
    string columns are categorical and numeric columns numeric; naming ``categorical``
    makes those (integers included) categorical and every other number numeric.
    ``standardize``: each numeric column is read scaled to mean 0 and sd 1 (its statistics
    taken in the same pass; they hold no label)."""
    import pyarrow as pa

    fmt, files = list_files(path, fmt)
    schema, parts = schema_and_parts(path, fmt, files)
    names = tuple(schema.names)
    if label not in names:
        raise SourceError(f"data.label: no column {label!r} in {path!r}; its columns are: {', '.join(names)}")
    for key, cols in (("data.categorical", categorical), ("data.numeric", numeric)):
        unknown = [c for c in cols if c not in names]
        if unknown:
            raise SourceError(f"{key}: unknown columns {unknown}; the columns are: {', '.join(names)}")
        if label in cols:
            raise SourceError(f"{key} lists the label column {label!r}; leave it out")
    both = sorted(set(categorical) & set(numeric))
    if both:
        raise SourceError(f"data.categorical and data.numeric both list {both}; a column is one or the other")
    others = [c for c in names if c != label]
    kind = {c: schema.field(c).type for c in names}
    cat = list(categorical) or ([] if numeric else [c for c in others if is_categorical(kind[c])])
    num = list(numeric) or [c for c in others if c not in cat and is_numeric(kind[c])]
    for c in num:
        if not is_numeric(kind[c]):
            raise SourceError(f"data.numeric: column {c!r} in {path!r} is {kind[c]}, not a number; list it in data.categorical or leave it out")
    for c in cat:
        if not (is_categorical(kind[c]) or pa.types.is_integer(kind[c])):
            raise SourceError(f"data.categorical: column {c!r} in {path!r} is {kind[c]}; a categorical column holds strings or integers")
    unused = [f"{c} ({kind[c]})" for c in others if c not in cat and c not in num]
    if unused and not (categorical or numeric):
        raise SourceError(f"columns of {path!r} that are neither numeric nor categorical: {', '.join(unused)}; name the columns "
                          "to use in data.categorical and data.numeric")
    if not cat:
        raise SourceError(f"{path!r} has no categorical column (strings, or integers named in data.categorical); the model needs at least one")
    if not (is_numeric(kind[label])):
        raise SourceError(f"data.label: column {label!r} in {path!r} is {kind[label]}; a label is 0 or 1")
    fs, _ = filesystem(path)
    counted, at = [], 0
    # The numeric columns are read here too: a missing cell is meant (it reads as 0, counted
    # for the run's read-out), an infinite one is not, and the model would take it silently.
    tally = CellTally(num)
    sums = np.zeros((3, len(num)))  # present cells, their sum and sum of squares, per numeric column
    positives = 0
    for part in parts:
        table = read_file_columns(fs, part, fmt, [label, *num], {c: pa.float64() for c in (label, *num)})
        y = table.column(label)
        bad = _not_binary(y)
        if bad is not None:
            i, value = bad
            raise SourceError(f"data.label: column {label!r} of {path!r} holds {value!r} at row {at + i}; a label is 0 or 1 (clicked or not)")
        positives += int(np.count_nonzero(y.to_numpy(zero_copy_only=False) == 1.0))
        for j, c in enumerate(num):
            cells = float32_cells(table.column(c))
            tally.add(c, cells, at)
            present = cells[np.isfinite(cells)].astype(np.float64)
            sums[:, j] += (len(present), present.sum(), np.square(present).sum())
        counted.append(FilePart(part.path, table.num_rows, part.row_groups))
        at += table.num_rows
    tally.refuse_infinite("data.numeric", path, "", "a missing value reads as 0, an infinite one has no meaning: replace those cells with a finite "
                          "value or leave them empty, or leave the column out (name the columns to use in data.numeric)")
    spec = TableSpec(fmt, path, at, tuple(cat) + tuple(num), label, files=tuple(counted))
    scale = ()
    if standardize:
        mean = sums[1] / np.maximum(sums[0], 1)
        sd = np.sqrt(np.maximum(sums[2] / np.maximum(sums[0], 1) - mean ** 2, 0.0))
        scale = tuple((float(m), float(s) if s > 1e-12 else 1.0) for m, s in zip(mean, sd))  # a constant column stays centred at 0
    hashed_as = tuple("int" if fmt == "parquet" and pa.types.is_integer(kind[c]) else "string" for c in cat)
    return CTRTable(spec, tuple(cat), tuple(num), tuple(tally.missing_counts().items()), positives, names, hashed_as, scale)


def read_out(t: CTRTable, train_rows: int, held_out: int, held_out_clicked: int) -> tuple[str, dict]:
    """(a line, an event's fields) saying what a run read from the table: each column's role
    (label, embedding field, numeric, not used), the rows trained on and held out (the last
    ``held_out``), the share clicked in each, and the missing cells."""
    train_clicked = t.positives - held_out_clicked
    roles = {t.spec.label: "label", **{c: "embedding field" for c in t.categorical},
             **{c: "numeric" + (" (standardised)" if t.scale else "") for c in t.numeric}}
    roles.update({c: "not used" for c in t.columns if c not in roles})
    unused = [c for c, r in roles.items() if r == "not used"]
    as_what = "the mean" if t.scale else "0"
    missing = f"; missing cells read as {as_what}: " + ", ".join(f"{col} ({n})" for col, n in t.missing) if t.missing else ""
    line = (f"read {t.spec.rows:,} rows of {t.spec.name}: label {t.spec.label!r}; embedding fields {', '.join(t.categorical)}; "
            f"numeric {', '.join(t.numeric) or 'none'}{'; not used: ' + ', '.join(unused) if unused else ''}; "
            f"{train_rows:,} rows train ({train_clicked / max(train_rows, 1):.1%} clicked), the last {held_out:,} held out "
            f"({held_out_clicked / max(held_out, 1):.1%} clicked){missing}")
    event = dict(path=t.spec.name, rows=t.spec.rows, label=t.spec.label, roles=roles, categorical=list(t.categorical), numeric=list(t.numeric),
                 standardized={c: {"mean": m, "sd": s} for c, (m, s) in zip(t.numeric, t.scale)}, train_rows=train_rows,
                 held_out_rows=held_out, train_clicked=train_clicked, held_out_clicked=held_out_clicked, missing=dict(t.missing))
    return line, event


def _not_binary(column) -> tuple[int, object] | None:
    """(row, value) of the first label that is missing or not 0/1; None when all are."""
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)
    bad = np.isnan(values) | ((values != 0.0) & (values != 1.0))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return i, (None if np.isnan(values[i]) else float(values[i]))


def hash_values(values, buckets: int) -> np.ndarray:
    """Bucket of every value of a pyarrow array (strings, integers, or dictionary-encoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if pa.types.is_integer(values.type):
        ints = values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
        out = (_mix(ints) % np.uint64(buckets)).astype(np.int64)
        if values.null_count:
            out[np.asarray(values.is_null())] = _bucket(NULL_TOKEN, buckets)
        return out
    encoded = pc.dictionary_encode(values.cast(pa.string()))
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    table = np.array([_bucket(v, buckets) for v in encoded.dictionary.to_pylist()] + [_bucket(NULL_TOKEN, buckets)], dtype=np.int64)
    idx = encoded.indices.fill_null(len(encoded.dictionary)).to_numpy(zero_copy_only=False)
    return table[idx]


def _bucket(text: str, buckets: int) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=b"raylane-ctr").digest()
    return int.from_bytes(digest, "little") % buckets


def read_ctr_rows(table: CTRTable, buckets: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` as the generated data comes: ids ``[n, fields, 1]`` int64,
    numeric ``[n, numeric]`` float32 (scaled by ``table.scale``; missing: 0), labels ``[n]`` float32."""
    import pyarrow as pa

    spec, n = table.spec, stop - start
    if not 0 <= start <= stop <= spec.rows:
        raise ValueError(f"need 0 <= start <= stop <= {spec.rows}, got start={start}, stop={stop}")
    ids = np.empty((n, len(table.categorical), 1), dtype=np.int64)
    numeric = np.empty((n, len(table.numeric)), dtype=np.float32)
    labels = np.empty(n, dtype=np.float32)
    types = {**{c: pa.string() for c in table.categorical}, **{c: pa.float64() for c in (*table.numeric, spec.label)}}
    tally = CellTally(table.numeric)
    filled = 0
    for part, _ in range_tables(spec, [*spec.features, spec.label], types, start, stop):
        k = part.num_rows
        for f, c in enumerate(table.categorical):
            ids[filled : filled + k, f, 0] = hash_values(part.column(c).combine_chunks(), buckets)
        for j, c in enumerate(table.numeric):
            numeric[filled : filled + k, j] = float32_cells(part.column(c))
            tally.add(c, numeric[filled : filled + k, j], start + filled)
        labels[filled : filled + k] = part.column(spec.label).cast(pa.float32()).to_numpy()
        filled += k
    if filled != n:
        raise SourceError(f"data.path {spec.name!r}: read {filled} rows for [{start}, {stop}); the files changed since the job started")
    # The driver refused infinite cells; seeing one here means the files changed since.
    tally.refuse_infinite("data.numeric", spec.name, f", rows [{start}, {stop})", "the files changed since the job checked them: fix them and start again")
    if table.scale:
        mean, sd = (np.array(v, np.float32) for v in zip(*table.scale))
        numeric -= mean
        numeric /= sd
    numeric[np.isnan(numeric)] = 0.0  # missing reads as 0 (the mean, when scaled); np.nan_to_num would also turn an infinity into float32's largest number
    return ids, numeric, labels
