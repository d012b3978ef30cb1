"""File sources of tabular rows: Parquet or CSV files and folders on any ``pyarrow.fs``
filesystem, peeked at by the driver and read in row ranges by each trainer.

Categorical features: a string (or dictionary-encoded) column, or a numeric one the user
names, becomes one categorical feature. Its categories are read on the driver, once, over
every file, and travel in the :class:`~raylane.actors.tabular.TableSpec`; every trainer
codes its rows with the same list (a value's code is its index), which xgboost's
collective needs: the same category must have the same code on every worker.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from raylane.actors.table_spec import FORMATS, SKLEARN_DATASETS, SYNTHETIC_TASKS, FilePart, SourceError, TableSpec, check_feature_names, label_array

_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
MAX_CATEGORIES = 65_536
"""More distinct values than this in a categorical column is more likely an id than a feature."""


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


def list_files(uri: str, fmt: str) -> tuple[str, list[str]]:
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


def schema_and_parts(uri: str, fmt: str, files: list[str]):
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


def read_file_columns(fs, part: FilePart, fmt: str, columns: Sequence[str], types: dict | None = None):
    """One whole file's ``columns`` as a pyarrow Table."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if fmt == "parquet":
        with fs.open_input_file(part.path) as f:
            return pq.ParquetFile(f).read(columns=list(columns))
    with fs.open_input_stream(part.path) as f:
        return pacsv.read_csv(f, convert_options=pacsv.ConvertOptions(include_columns=list(columns), column_types=types or {}, strings_can_be_null=True))


def is_numeric(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type) or pa.types.is_decimal(arrow_type)


def is_categorical(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_dictionary(arrow_type)


def _values(column):
    """A column with dictionary encoding undone (its values, not its indices)."""
    import pyarrow as pa

    return column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column


def float32_cells(column) -> np.ndarray:
    """A numeric pyarrow column as the models read it: float32, a null as NaN. A finite
    number beyond float32's range becomes infinite here, which is why the checks look at
    this and not at the column's own type."""
    import pyarrow as pa

    return np.asarray(column.cast(pa.float32()).to_numpy(zero_copy_only=False), dtype=np.float32)


def show_rows(rows: np.ndarray, limit: int = 5) -> str:
    """The first few row indices, for an error message.

    >>> show_rows(np.array([3, 9, 12, 40, 41, 77]))
    '3, 9, 12, 40, 41, ...'
    """
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    return shown + (", ..." if len(rows) > limit else "")


class CellTally:
    """Missing (null or NaN) and infinite cells of numeric columns, counted over row blocks
    read in order, so one error can give a column's total and its first rows."""

    def __init__(self, columns: Sequence[str]):
        self.missing = dict.fromkeys(columns, 0)
        self.infinite = dict.fromkeys(columns, 0)
        self.first: dict[str, list[int]] = {c: [] for c in columns}

    def add(self, column: str, values: np.ndarray, offset: int) -> None:
        """Count the cells of ``values`` (float32), whose first row is global row ``offset``."""
        self.missing[column] += int(np.isnan(values).sum())
        bad = np.flatnonzero(np.isinf(values))
        if bad.size:
            self.infinite[column] += int(bad.size)
            first = self.first[column]
            first.extend(int(r) + offset for r in bad[: max(0, 6 - len(first))])

    def missing_counts(self) -> dict[str, int]:
        """{column: missing cells} for the columns that have any."""
        return {c: n for c, n in self.missing.items() if n}

    def refuse_infinite(self, key: str, source: str, where: str, fix: str) -> None:
        """A :class:`SourceError` naming every column with infinite cells, how many and their first rows."""
        bad = [c for c, n in self.infinite.items() if n]
        if bad:
            cells = "; ".join(f"column {c!r} holds {self.infinite[c]} (first at rows {show_rows(np.array(self.first[c]))})" for c in bad)
            raise SourceError(f"{key}: infinite values (or numbers beyond float32's range, about 3.4e38) in {source!r}{where}: {cells}; {fix}")


def describe_files(source: str, name: str, label: str, features: Sequence[str], fmt: str, *, drop: Sequence[str] = (),
                   categorical: Sequence[str] = ()) -> tuple[TableSpec, np.ndarray]:
    """The spec of a file source and its labels (read on the driver), checked."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fmt, files = list_files(name, fmt)
    schema, parts = schema_and_parts(name, fmt, files)
    if label not in schema.names:
        raise SourceError(f"data.label: no column {label!r} in {source!r}; its columns are: {', '.join(schema.names)}")
    chosen = check_feature_names(features, tuple(schema.names), label, drop)
    not_features = [c for c in categorical if c not in chosen]
    if not_features:
        raise SourceError(f"data.categorical: {not_features} are not feature columns; the features are: {', '.join(chosen)}")
    bad = [f"{c} ({schema.field(c).type})" for c in chosen if not (is_numeric(schema.field(c).type) or is_categorical(schema.field(c).type))]
    if bad:
        raise SourceError(
            f"data.features: columns in {source!r} that are neither numeric nor categorical (strings): {', '.join(bad)}. "
            f"Leave them out with data.drop=[...], or list the columns to use in data.features"
        )
    if not is_numeric(schema.field(label).type):
        raise SourceError(f"data.label: column {label!r} in {source!r} is {schema.field(label).type}; labels must be numbers (encode classes as 0..k-1)")
    cats = [c for c in chosen if c in categorical or is_categorical(schema.field(c).type)]
    fs, _ = filesystem(name)
    labels, counted, seen = [], [], {c: [] for c in cats}
    for part in parts:
        types = {label: pa.float64(), **{c: (pa.string() if is_categorical(schema.field(c).type) else pa.float64()) for c in cats}}
        try:
            table = read_file_columns(fs, part, fmt, [label, *cats], types)
        except (OSError, ValueError) as exc:
            raise SourceError(f"data.source: cannot read columns {[label, *cats]} of {part.path!r}: {exc}") from exc
        labels.append(label_array(table.column(label), source, label, offset=sum(p.rows for p in counted)))
        for c in cats:
            seen[c].append(pc.unique(_values(table.column(c))))
        counted.append(FilePart(part.path, table.num_rows, part.row_groups))
    categories = []
    for c in cats:
        merged = pa.chunked_array(seen[c]).combine_chunks() if seen[c] else pa.array([], pa.string())
        values = pc.unique(merged).drop_null()
        if pa.types.is_floating(values.type):
            values = values.filter(pc.invert(pc.is_nan(values)))  # NaN is missing, not a category
        values = values.take(pc.array_sort_indices(values))
        if len(values) > MAX_CATEGORIES:
            raise SourceError(f"data.features: column {c!r} in {source!r} has {len(values):,} distinct values; more than {MAX_CATEGORIES:,} "
                              f"categories is more likely an id than a feature: leave it out with data.drop=[{c!r}] or encode it yourself")
        categories.append((c, tuple(values.to_pylist())))
    y = np.concatenate(labels) if labels else np.zeros(0)
    return TableSpec(fmt, name, len(y), chosen, label, files=tuple(counted), categories=tuple(categories)), y


def _coder(values: tuple):
    """(the type a column is read as, the value set its codes index) for one categorical column."""
    import pyarrow as pa

    kind = pa.string() if all(isinstance(v, str) for v in values) else pa.float64()
    return kind, pa.array(values, type=kind)


def range_tables(spec: TableSpec, columns: Sequence[str], types: dict, start: int, stop: int):
    """Yield ``(table, file_start)``: pyarrow tables of ``columns`` holding rows
    ``[start, stop)`` of a file source in order, and the global index of their file's first
    row. Parquet reads only the row groups that overlap; CSV skips the files before and stops
    after the last row (``types``: CSV column types; an empty field reads as missing)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    fs, _ = filesystem(spec.name)
    file_start = 0
    for part in spec.files:
        lo, hi = max(start, file_start), min(stop, file_start + part.rows)
        if lo < hi:
            if spec.kind == "parquet":
                bounds = np.cumsum((0,) + part.row_groups) + file_start
                groups = [g for g in range(len(part.row_groups)) if bounds[g] < hi and bounds[g + 1] > lo]
                with fs.open_input_file(part.path) as f:
                    table = pq.ParquetFile(f).read_row_groups(groups, columns=list(columns))
                yield table.slice(lo - int(bounds[groups[0]]), hi - lo), file_start
            else:
                opts = pacsv.ConvertOptions(include_columns=list(columns), column_types=types, strings_can_be_null=True)
                with fs.open_input_stream(part.path) as f:
                    reader, at = pacsv.open_csv(f, convert_options=opts), file_start
                    for batch in reader:
                        b_lo, b_hi = max(lo, at), min(hi, at + batch.num_rows)
                        if b_lo < b_hi:
                            yield pa.Table.from_batches([batch.slice(b_lo - at, b_hi - b_lo)]), file_start
                        at += batch.num_rows
                        if at >= hi:
                            break
        file_start += part.rows
        if file_start >= stop:
            break


def read_file_rows(spec: TableSpec, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of a file source (see :func:`raylane.actors.tabular.read_rows`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = list(spec.features) + [spec.label]
    coders = {c: _coder(values) for c, values in spec.categories}
    # a stray string in a numeric CSV column fails here, naming it
    types = {c: coders[c][0] if c in coders else pa.float64() for c in columns}
    x = np.empty((stop - start, len(spec.features)), dtype=np.float32)
    y = np.empty(stop - start, dtype=np.float32)
    # The numeric features are read here only, never on the driver, so this is where an
    # infinite cell can be caught before xgboost fails on it without naming the column.
    tally = CellTally([f for f in spec.features if f not in coders])
    filled = 0
    for table, file_start in range_tables(spec, columns, types, start, stop):
        n = table.num_rows
        for j, name in enumerate(spec.features):
            column = table.column(name)
            if name in coders:  # the category's index in the driver's list; unknown or null: missing
                kind, value_set = coders[name]
                column = pc.index_in(_values(column).cast(kind), value_set=value_set)
            x[filled : filled + n, j] = column.cast(pa.float32()).to_numpy()
            if name not in coders:
                tally.add(name, x[filled : filled + n, j], start + filled)
        y[filled : filled + n] = label_array(table.column(spec.label), spec.name, spec.label, offset=file_start)
        filled += n
    if filled != stop - start:
        raise SourceError(f"data.source {spec.name!r}: read {filled} rows for [{start}, {stop}); the files changed since the job started")
    bad = [c for c, k in tally.infinite.items() if k]
    tally.refuse_infinite("data.features", spec.name, f", rows [{start}, {stop}) (this trainer's shard)",
                          "xgboost reads NaN or an empty cell as missing but cannot train on an infinite one: replace those cells with a "
                          f"finite value or leave them empty, or leave the column out with data.drop={bad}")
    if not np.isfinite(y).all():
        raise SourceError(f"data.label: NaN or infinite labels in rows [{start}, {stop}) of {spec.name!r}")
    return x, y
