"""What a tabular source is, shared by the table readers: the formats and built-in sources,
:class:`TableSpec` (what the driver peeked at and ships to the trainers), the label's
summary, and the checks every source makes of its columns. :mod:`raylane.actors.tabular`
describes and reads sources (generated, scikit-learn's, files through
:mod:`raylane.actors.tabular_files`); both import this module, not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SYNTHETIC_TASKS = ("classification", "regression")
# scikit-learn's bundled single-target datasets (no download); each returns (data, target).
SKLEARN_DATASETS = ("breast_cancer", "diabetes", "digits", "iris", "wine")
FORMATS = ("parquet", "csv")


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
    categories: tuple[tuple[str, tuple], ...] = ()
    """(column, its category values in code order) for each categorical feature; a value's
    code is its index, and a value not listed (or a null) reads as missing."""

    @property
    def feature_types(self) -> list[str] | None:
        """xgboost's types per feature column: ``c`` categorical, ``q`` quantitative; None
        when every column is quantitative."""
        cats = {c for c, _ in self.categories}
        return [("c" if f in cats else "q") for f in self.features] if cats else None


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


def check_feature_names(features: Sequence[str], columns: Sequence[str], label: str, drop: Sequence[str] = ()) -> tuple[str, ...]:
    """The feature columns: ``features`` (every column but the label when empty) less ``drop``."""
    unknown_drop = [c for c in drop if c not in columns]
    if unknown_drop:
        raise SourceError(f"data.drop: unknown columns {unknown_drop}; the columns are: {', '.join(columns)}")
    if label in drop:
        raise SourceError(f"data.drop lists the label column {label!r}; to predict another column set data.label")
    if not features:
        return tuple(c for c in columns if c != label and c not in drop)
    unknown = [f for f in features if f not in columns]
    if unknown:
        raise SourceError(f"data.features: unknown columns {unknown}; the columns are: {', '.join(columns)}")
    if label in features:
        raise SourceError(f"data.features lists the label column {label!r}; leave it out")
    if len(set(features)) != len(features):
        raise SourceError(f"data.features lists a column twice: {list(features)}")
    both = [f for f in features if f in drop]
    if both:
        raise SourceError(f"data.features and data.drop both list {both}; give the columns to use, or the ones to leave out")
    return tuple(features)


def label_array(column, source: str, label: str, offset: int = 0) -> np.ndarray:
    if column.null_count:
        first = int(np.flatnonzero(np.asarray(column.is_null()))[0]) + offset
        raise SourceError(f"data.label: column {label!r} in {source!r} has {column.null_count} empty labels (first at row {first}); drop or fill those rows")
    return column.to_numpy().astype(np.float64, copy=False)
