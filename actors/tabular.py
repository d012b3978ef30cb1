"""Tabular rows for data-parallel trainers: what a source holds, and each trainer's own share of it.

A dataset is a sequence of rows with global indices ``0 .. rows-1``. The driver builds a
:class:`TableSpec` with :func:`describe` (a cheap peek: file listings, Parquet metadata, the
label column) and ships only that spec to the trainers; each trainer then reads the rows
``[start, stop)`` it was given with :func:`read_rows`. Sources:

* ``synthetic:classification`` / ``synthetic:regression``: rows generated from their index
  (blocks of :data:`BLOCK` rows, each from its own seeded generator), so any trainer makes any
  range, of any dataset size, without files.
* ``sklearn:<name>``: a dataset that ships inside scikit-learn (no download).
* a Parquet or CSV file or folder on any ``pyarrow.fs`` filesystem (a local path or a URI
  such as ``s3://bucket/train/``). Parquet shards read only the row groups that overlap them;
  CSV shards skip the files before them and stop reading after their last row.

The evaluation split is per row, from a hash of its global index and the seed
(:func:`eval_mask`), so the same rows are held out whatever the number of trainers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

BLOCK = 16_384  # rows per generated block; any row range is built from whole blocks
SYNTHETIC_TASKS = ("classification", "regression")
# scikit-learn's bundled single-target datasets (no download); each returns (data, target).
SKLEARN_DATASETS = ("breast_cancer", "diabetes", "digits", "iris", "wine")
FORMATS = ("parquet", "csv")
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}


class SourceError(ValueError):
    """The data cannot be used as asked; the message names the value and what would be valid."""


@dataclass(frozen=True)
class FilePart:
    """One file of a file source, in global row order."""

    path: str
    """Path within the filesystem (no scheme)."""
    rows: int
    """Rows in the file."""
    row_groups: tuple[int, ...] = ()
    """Parquet: rows per row group, in order. CSV: empty."""


@dataclass(frozen=True)
class TableSpec:
    """What a trainer needs to read any range of rows itself. Small and picklable."""

    kind: str
    """``synthetic``, ``sklearn``, ``parquet`` or ``csv``."""
    name: str
    """The synthetic task, the sklearn dataset name, or the file source as the user gave it."""
    rows: int
    """Rows in the whole dataset."""
    features: tuple[str, ...]
    """Feature columns, in the order of the matrix columns."""
    label: str
    """Label column."""
    seed: int = 0
    """Seed of generated rows (synthetic sources)."""
    files: tuple[FilePart, ...] = ()
    """The files of a file source, in global row order."""


@dataclass(frozen=True)
class LabelSummary:
    """What the driver learned from the labels, to pick and check the objective."""

    minimum: float
    maximum: float
    binary: bool
    """Every label is 0 or 1."""
    integral: bool
    """Every label is a whole number."""
    distinct: int | None = None
    """How many different values the labels take, counted when every label is a whole number;
    None otherwise, and for generated regression labels (not read on the driver)."""


# ---------------------------------------------------------------- synthetic rows


def _coefficients(seed: int, num_features: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).normal(size=num_features).astype(np.float32)


def _signal(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A target trees have to work for: a sparse linear part, an interaction, a wave, a step."""
    k = min(x.shape[1], 8)
    s = x[:, :k] @ w[:k] / math.sqrt(k)
    if x.shape[1] >= 2:
        s += x[:, 0] * x[:, 1]
    if x.shape[1] >= 3:
        s += np.sin(2.0 * x[:, 2])
    if x.shape[1] >= 4:
        s += 0.8 * (x[:, 3] > 0.5) - 0.3
    return s


def synthetic_rows(task: str, seed: int, num_features: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of a generated problem: X (n, num_features) float32, y (n,) float32.

    >>> x, y = synthetic_rows("classification", 0, 4, 10, 13)
    >>> x.shape, sorted(set(y.tolist())) <= [0.0, 1.0]
    ((3, 4), True)
    """
    if task not in SYNTHETIC_TASKS:
        raise SourceError(f"unknown synthetic task {task!r}; valid: {', '.join(SYNTHETIC_TASKS)}")
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    w = _coefficients(seed, num_features)
    x_out = np.empty((stop - start, num_features), dtype=np.float32)
    y_out = np.empty(stop - start, dtype=np.float32)
    for b in range(start // BLOCK, (stop + BLOCK - 1) // BLOCK):
        rng = np.random.default_rng([seed, 1, b])
        x = rng.standard_normal((BLOCK, num_features), dtype=np.float32)
        noise = rng.standard_normal(BLOCK, dtype=np.float32)
        s = _signal(x, w)
        y = (s + noise > 0).astype(np.float32) if task == "classification" else s + 0.5 * noise
        lo, hi = max(start - b * BLOCK, 0), min(stop - b * BLOCK, BLOCK)
        at = b * BLOCK + lo - start
        x_out[at : at + hi - lo] = x[lo:hi]
        y_out[at : at + hi - lo] = y[lo:hi]
    return x_out, y_out


def synthetic_features(num_features: int) -> tuple[str, ...]:
    return tuple(f"f{i}" for i in range(num_features))


# ---------------------------------------------------------------- scikit-learn datasets


@lru_cache(maxsize=4)
def _sklearn(name: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    if name not in SKLEARN_DATASETS:
        raise SourceError(f"unknown scikit-learn dataset {name!r}; bundled ones: {', '.join(SKLEARN_DATASETS)}")
    from sklearn import datasets

    bunch = getattr(datasets, f"load_{name}")()
    names = tuple(str(n) for n in getattr(bunch, "feature_names", [f"f{i}" for i in range(bunch.data.shape[1])]))
    return np.ascontiguousarray(bunch.data, dtype=np.float32), np.asarray(bunch.target, dtype=np.float32), names


# ---------------------------------------------------------------- files


def filesystem(uri: str):
    """(pyarrow filesystem, path) for a local path or any URI pyarrow knows (s3://, gs://, file://)."""
    import os

    import pyarrow.fs as pafs

    if "://" in uri:
        try:
            return pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # pyarrow raises several types for bad or unreachable URIs
            raise SourceError(f"data.source: cannot open {uri!r}: {exc}") from exc
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def _list_files(uri: str, fmt: str) -> tuple[str, list[str]]:
    """The format and the sorted data files of a file or folder."""
    import os

    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise SourceError(
            f"data.source: no such file or folder: {uri!r}. Give a Parquet or CSV file or folder, "
            f"'sklearn:<{'|'.join(SKLEARN_DATASETS)}>' or 'synthetic:<{'|'.join(SYNTHETIC_TASKS)}>'"
        )
    if info.type == pafs.FileType.File:
        paths = [path]
    else:
        entries = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        # Skip marker and hidden files that writers leave beside the data (_SUCCESS, .crc).
        paths = sorted(e.path for e in entries if e.type == pafs.FileType.File and not os.path.basename(e.path).startswith(("_", ".")))
    by_ext = {p: _EXTENSIONS.get(os.path.splitext(p)[1].lower()) for p in paths}
    if fmt == "auto":
        found = sorted({f for f in by_ext.values() if f})
        if len(found) != 1:
            what = "both Parquet and CSV files" if found else "no .parquet, .pq or .csv files"
            raise SourceError(f"data.source {uri!r} holds {what}; set data.format to one of {', '.join(FORMATS)}")
        fmt = found[0]
    if info.type == pafs.FileType.File:
        files = paths
    else:
        files = [p for p, f in by_ext.items() if f == fmt] or [p for p, f in by_ext.items() if f is None]
    if not files:
        raise SourceError(f"data.source: folder {uri!r} holds no {fmt} files")
    return fmt, files


def _schema_and_parts(uri: str, fmt: str, files: list[str]):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    fs, _ = filesystem(uri)
    schema, parts = None, []
    for path in files:
        try:
            if fmt == "parquet":
                with fs.open_input_file(path) as f:
                    meta = pq.ParquetFile(f).metadata
                file_schema = meta.schema.to_arrow_schema()
                groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
                parts.append(FilePart(path, meta.num_rows, groups))
            else:
                with fs.open_input_stream(path) as f:
                    file_schema = pacsv.open_csv(f).schema
                parts.append(FilePart(path, -1))  # counted while the labels are read
        except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
            raise SourceError(f"data.source: cannot read {path!r} as {fmt}: {exc}") from exc
        if schema is None:
            schema = file_schema
        elif file_schema.names != schema.names:
            raise SourceError(f"data.source: {path!r} has columns {file_schema.names}, but {files[0]!r} has {schema.names}; all files must have the same columns")
    return schema, parts


def _read_file_columns(fs, part: FilePart, fmt: str, columns: Sequence[str], types: dict | None = None):
    """One whole file's ``columns`` as a pyarrow Table."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if fmt == "parquet":
        with fs.open_input_file(part.path) as f:
            return pq.ParquetFile(f).read(columns=list(columns))
    with fs.open_input_stream(part.path) as f:
        return pacsv.read_csv(f, convert_options=pacsv.ConvertOptions(include_columns=list(columns), column_types=types or {}))


def _is_numeric(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type) or pa.types.is_decimal(arrow_type)


# ---------------------------------------------------------------- the driver's peek


def parse_source(source: str) -> tuple[str, str]:
    """``("synthetic", task)``, ``("sklearn", name)`` or ``("file", uri)``, checking the names."""
    if source.startswith("synthetic:"):
        task = source.split(":", 1)[1]
        if task not in SYNTHETIC_TASKS:
            raise SourceError(f"data.source: unknown synthetic task {task!r}; valid: {', '.join('synthetic:' + t for t in SYNTHETIC_TASKS)}")
        return "synthetic", task
    if source.startswith("sklearn:"):
        name = source.split(":", 1)[1]
        if name not in SKLEARN_DATASETS:
            raise SourceError(f"data.source: unknown scikit-learn dataset {name!r}; bundled ones: {', '.join('sklearn:' + n for n in SKLEARN_DATASETS)}")
        return "sklearn", name
    if not source.strip():
        raise SourceError("data.source is empty; give a Parquet or CSV file or folder, sklearn:<name> or synthetic:<task>")
    return "file", source


def default_label(kind: str) -> str:
    return {"synthetic": "label", "sklearn": "target"}.get(kind, "")


def describe(source: str, *, label: str = "", features: Sequence[str] = (), fmt: str = "auto", rows: int = 0, num_features: int = 0, seed: int = 0) -> tuple[TableSpec, LabelSummary]:
    """Peek at a source on the driver: its columns, row count and labels, checked.

    Reads file listings, Parquet footers and the label column only; never the features.
    Raises :class:`SourceError` for a missing file, a missing label column, non-numeric
    feature columns, or null / NaN / infinite labels.
    """
    kind, name = parse_source(source)
    label = label or default_label(kind)
    if kind == "synthetic":
        if rows < 1 or num_features < 1:
            raise SourceError(f"data.rows and data.num_features must be >= 1 for synthetic data, got {rows} and {num_features}")
        if label != "label":
            raise SourceError(f"data.label: synthetic data has one label column, 'label'; got {label!r}")
        if features:
            raise SourceError("data.features cannot pick columns of synthetic data; set data.num_features instead")
        names = synthetic_features(num_features)
        binary = name == "classification"
        summary = LabelSummary(0.0, 1.0, True, True, 2) if binary else LabelSummary(-math.inf, math.inf, False, False)
        return TableSpec("synthetic", name, rows, names, label, seed=seed), summary
    if kind == "sklearn":
        x, y, names = _sklearn(name)
        if label != "target":
            raise SourceError(f"data.label: scikit-learn dataset {name!r} has one label column, 'target'; got {label!r}")
        chosen = _check_feature_names(features, names, label)
        return TableSpec("sklearn", name, len(y), chosen, label), _summarize(y, source, label)
    if not label:
        raise SourceError(f"data.label is required for a file source ({source!r}); set it to the label column's name")
    fmt, files = _list_files(name, fmt)
    schema, parts = _schema_and_parts(name, fmt, files)
    if label not in schema.names:
        raise SourceError(f"data.label: no column {label!r} in {source!r}; its columns are: {', '.join(schema.names)}")
    chosen = _check_feature_names(features, tuple(schema.names), label)
    bad = [f"{c} ({schema.field(c).type})" for c in chosen if not _is_numeric(schema.field(c).type)]
    if bad:
        raise SourceError(
            f"data.features: non-numeric feature columns in {source!r}: {', '.join(bad)}. Encode them as numbers, "
            f"or list only numeric columns in data.features"
        )
    if not _is_numeric(schema.field(label).type):
        raise SourceError(f"data.label: column {label!r} in {source!r} is {schema.field(label).type}; labels must be numbers (encode classes as 0..k-1)")
    import pyarrow as pa

    fs, _ = filesystem(name)
    labels, counted = [], []
    for part in parts:
        try:
            table = _read_file_columns(fs, part, fmt, [label], {label: pa.float64()})
        except (OSError, ValueError) as exc:
            raise SourceError(f"data.label: cannot read column {label!r} of {part.path!r}: {exc}") from exc
        labels.append(_label_array(table.column(label), source, label, offset=sum(p.rows for p in counted)))
        counted.append(FilePart(part.path, table.num_rows, part.row_groups))
    y = np.concatenate(labels) if labels else np.zeros(0)
    return TableSpec(fmt, name, len(y), chosen, label, files=tuple(counted)), _summarize(y, source, label)


def _check_feature_names(features: Sequence[str], columns: Sequence[str], label: str) -> tuple[str, ...]:
    if not features:
        return tuple(c for c in columns if c != label)
    unknown = [f for f in features if f not in columns]
    if unknown:
        raise SourceError(f"data.features: unknown columns {unknown}; the columns are: {', '.join(columns)}")
    if label in features:
        raise SourceError(f"data.features lists the label column {label!r}; leave it out")
    if len(set(features)) != len(features):
        raise SourceError(f"data.features lists a column twice: {list(features)}")
    return tuple(features)


def _label_array(column, source: str, label: str, offset: int = 0) -> np.ndarray:
    if column.null_count:
        first = int(np.flatnonzero(np.asarray(column.is_null()))[0]) + offset
        raise SourceError(f"data.label: column {label!r} in {source!r} has {column.null_count} empty labels (first at row {first}); drop or fill those rows")
    return column.to_numpy().astype(np.float64, copy=False)


def _summarize(y: np.ndarray, source: str, label: str) -> LabelSummary:
    bad = ~np.isfinite(y)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise SourceError(f"data.label: column {label!r} in {source!r} has {int(bad.sum())} NaN or infinite labels (first at row {first}, value {y[first]}); drop or fix those rows")
    if len(y) == 0:
        raise SourceError(f"data.source {source!r} has no rows")
    integral = bool((y == np.round(y)).all())
    distinct = int(np.unique(y).size) if integral else None
    return LabelSummary(float(y.min()), float(y.max()), bool(np.isin(y, (0.0, 1.0)).all()), integral, distinct)


# ---------------------------------------------------------------- a trainer's own rows


def read_rows(spec: TableSpec, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` as X (n, features) float32, C order, and y (n,) float32.

    Feature nulls become NaN (xgboost's missing value); a null or non-finite label raises.
    """
    if not 0 <= start <= stop <= spec.rows:
        raise ValueError(f"need 0 <= start <= stop <= {spec.rows}, got start={start}, stop={stop}")
    if spec.kind == "synthetic":
        return synthetic_rows(spec.name, spec.seed, len(spec.features), start, stop)
    if spec.kind == "sklearn":
        x, y, names = _sklearn(spec.name)
        cols = [names.index(f) for f in spec.features]
        return np.ascontiguousarray(x[start:stop][:, cols]), y[start:stop].copy()
    return _read_file_rows(spec, start, stop)


def _read_file_rows(spec: TableSpec, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    fs, _ = filesystem(spec.name)
    columns = list(spec.features) + [spec.label]
    x = np.empty((stop - start, len(spec.features)), dtype=np.float32)
    y = np.empty(stop - start, dtype=np.float32)
    filled = 0
    file_start = 0
    for part in spec.files:
        lo, hi = max(start, file_start), min(stop, file_start + part.rows)
        if lo < hi:
            tables = []
            if spec.kind == "parquet":
                # Only the row groups that overlap [lo, hi).
                bounds = np.cumsum((0,) + part.row_groups) + file_start
                groups = [g for g in range(len(part.row_groups)) if bounds[g] < hi and bounds[g + 1] > lo]
                with fs.open_input_file(part.path) as f:
                    table = pq.ParquetFile(f).read_row_groups(groups, columns=columns)
                tables.append(table.slice(lo - int(bounds[groups[0]]), hi - lo))
            else:
                types = {c: pa.float64() for c in columns}  # a stray string in a column fails here, naming it
                opts = pacsv.ConvertOptions(include_columns=columns, column_types=types)
                with fs.open_input_stream(part.path) as f:
                    reader, at = pacsv.open_csv(f, convert_options=opts), file_start
                    for batch in reader:
                        b_lo, b_hi = max(lo, at), min(hi, at + batch.num_rows)
                        if b_lo < b_hi:
                            tables.append(pa.Table.from_batches([batch.slice(b_lo - at, b_hi - b_lo)]))
                        at += batch.num_rows
                        if at >= hi:
                            break
            for table in tables:
                n = table.num_rows
                for j, name in enumerate(spec.features):
                    x[filled : filled + n, j] = table.column(name).cast(pa.float32()).to_numpy()
                y[filled : filled + n] = _label_array(table.column(spec.label), spec.name, spec.label, offset=file_start)
                filled += n
        file_start += part.rows
        if file_start >= stop:
            break
    if filled != stop - start:
        raise SourceError(f"data.source {spec.name!r}: read {filled} rows for [{start}, {stop}); the files changed since the job started")
    if not np.isfinite(y).all():
        raise SourceError(f"data.label: NaN or infinite labels in rows [{start}, {stop}) of {spec.name!r}")
    return x, y


def eval_mask(seed: int, start: int, stop: int, fraction: float) -> np.ndarray:
    """True for the rows of ``[start, stop)`` held out for evaluation.

    A row's fate depends only on its global index and ``seed`` (a splitmix64 hash), so the
    held-out set is the same however the rows are sharded.
    """
    if fraction <= 0:
        return np.zeros(stop - start, dtype=bool)
    with np.errstate(over="ignore"):
        # splitmix64 of the (index + 1)-th state of a stream whose start the seed picks
        offset = np.uint64((0x9E3779B97F4A7C15 + seed * 0xD1B54A32D192ED03) % 2**64)
        z = (np.arange(start, stop, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + offset
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53) < fraction
