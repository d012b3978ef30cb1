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
from functools import lru_cache
from typing import Sequence

import numpy as np

from raylane.actors import tabular_files
from raylane.actors.table_spec import (  # noqa: F401 - the table's types and checks are also this module's surface
    FORMATS, SKLEARN_DATASETS, SYNTHETIC_TASKS, FilePart, LabelSummary, SourceError, TableSpec, check_feature_names, label_array,
)

BLOCK = 16_384  # rows per generated block; any row range is built from whole blocks


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


def describe(source: str, *, label: str = "", features: Sequence[str] = (), fmt: str = "auto", rows: int = 0, num_features: int = 0, seed: int = 0,
             drop: Sequence[str] = (), categorical: Sequence[str] = ()) -> tuple[TableSpec, LabelSummary]:
    """Peek at a source on the driver: its columns, row count and labels, checked.

    Reads file listings, Parquet footers, the label column and the categorical columns
    only; never the numeric features. ``drop`` leaves columns out; string columns of a file
    source are categorical features, and so are the numeric ones named in ``categorical``.
    Raises :class:`SourceError` for a missing file, a missing label column, a column that
    is neither numeric nor categorical, or null / NaN / infinite labels.
    """
    kind, name = parse_source(source)
    label = label or default_label(kind)
    if categorical and kind != "file":
        raise SourceError(f"data.categorical applies to file sources; {source!r} has numeric features only")
    if drop and kind == "synthetic":
        raise SourceError("data.drop cannot remove columns of synthetic data; set data.num_features instead")
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
        chosen = check_feature_names(features, names, label, drop)
        return TableSpec("sklearn", name, len(y), chosen, label), _summarize(y, source, label)
    if not label:
        raise SourceError(f"data.label is required for a file source ({source!r}); set it to the label column's name")
    spec, y = tabular_files.describe_files(source, name, label, features, fmt, drop=drop, categorical=categorical)
    return spec, _summarize(y, source, label)


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
    return tabular_files.read_file_rows(spec, start, stop)


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
