"""A click-through-rate model and generated click data with a planted signal.

Rows have ``fields`` categorical fields, each a bag of ``ids_per_field`` hashed ids in
``[0, buckets)`` (skewed: a few ids are common, most are rare, as in real logs), and
``dense_features`` numeric features. The label is a Bernoulli draw of
``sigmoid(sum of a hidden weight per (field, id) + a hidden linear function of the
numeric features + bias)``, so a model that learns the id weights (embeddings) and the
numeric weights gets a clearly better AUC than chance, and the Bayes AUC is known.
Rows are made in blocks of :data:`BLOCK` from ``(seed, block)``: any row range comes out
the same whoever generates it.

The model: one embedding table per field (mean over the bag), concatenated with the
numeric features, an MLP with one hidden layer, one logit. Its dense tensors are named
and shaped by :func:`dense_shapes`; its forward takes them and the pulled rows as plain
tensors, so a parameter-server worker and a single-process reference run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raylane.actors.ps_layout import _mix

BLOCK = 4096


@dataclass(frozen=True)
class CTRShape:
    """The data and the model's shape."""

    fields: int = 8
    """Categorical fields per row (one embedding table each)."""
    ids_per_field: int = 2
    """Hashed ids per field per row (an embedding bag, averaged)."""
    buckets: int = 10_000
    """Hash buckets per field (ids are in [0, buckets))."""
    dense_features: int = 8
    """Numeric features per row."""
    embedding_dim: int = 8
    """Width of an embedding row."""
    hidden: int = 32
    """Units in the MLP's hidden layer."""
    signal: float = 1.0
    """Strength of the planted id weights (larger: an easier problem)."""

    def check(self) -> None:
        for key in ("fields", "ids_per_field", "buckets", "embedding_dim", "hidden"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a whole number >= 1, got {value!r}")
        if self.dense_features < 0:
            raise ValueError(f"dense_features must be >= 0, got {self.dense_features}")


def table_name(field_index: int) -> str:
    return f"field{field_index}"


def hidden_weight(shape: CTRShape, seed: int, field_index: int, ids: np.ndarray) -> np.ndarray:
    """The planted weight of each id of a field (about N(0, signal^2) over ids)."""
    h = _mix(ids.astype(np.uint64) ^ (np.uint64(field_index + 1) << np.uint64(48)) ^ np.uint64(seed * 7919))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return shape.signal * np.sqrt(3.0) * (2.0 * u - 1.0)


def _block(shape: CTRShape, seed: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, b])
    n = BLOCK
    # Skewed ids: a power law over the buckets, so some rows of each table are hot.
    u = rng.random((n, shape.fields, shape.ids_per_field))
    ids = np.minimum((shape.buckets * u ** 3).astype(np.int64), shape.buckets - 1)
    dense = rng.standard_normal((n, shape.dense_features)).astype(np.float32)
    beta = np.linspace(-1.0, 1.0, shape.dense_features) if shape.dense_features else np.zeros(0)
    logit = dense.astype(np.float64) @ beta - 0.5
    for f in range(shape.fields):
        logit += hidden_weight(shape, seed, f, ids[:, f, :]).mean(axis=1)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ids, dense, labels


def rows(shape: CTRShape, seed: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[start, stop)``: ids ``[n, fields, ids_per_field]`` int64, numeric ``[n,
    dense_features]`` float32, labels ``[n]`` float32 (0 or 1)."""
    if not 0 <= start <= stop:
        raise ValueError(f"row range [{start}, {stop}) is not a range")
    parts = [_block(shape, seed, b) for b in range(start // BLOCK, (stop + BLOCK - 1) // BLOCK)]
    if not parts:
        return np.zeros((0, shape.fields, shape.ids_per_field), np.int64), np.zeros((0, shape.dense_features), np.float32), np.zeros(0, np.float32)
    ids, dense, labels = (np.concatenate(x) for x in zip(*parts))
    lo = start - (start // BLOCK) * BLOCK
    return ids[lo:lo + stop - start], dense[lo:lo + stop - start], labels[lo:lo + stop - start]


def dense_shapes(shape: CTRShape) -> dict[str, tuple[int, ...]]:
    d_in = shape.fields * shape.embedding_dim + shape.dense_features
    return {"l1.w": (shape.hidden, d_in), "l1.b": (shape.hidden,), "l2.w": (1, shape.hidden), "l2.b": (1,)}


def init_dense(shape: CTRShape, seed: int) -> dict[str, np.ndarray]:
    """The MLP's initial tensors (torch's default Linear init, seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shp in dense_shapes(shape).items():
        fan_in = shp[1] if len(shp) == 2 else dense_shapes(shape)[name.replace(".b", ".w")][1]
        bound = 1.0 / np.sqrt(fan_in)
        out[name] = ((torch.rand(shp, generator=g) * 2 - 1) * bound).numpy().astype(np.float32)
    return out


def forward(shape: CTRShape, dense: dict[str, torch.Tensor], rows_by_table: dict[str, torch.Tensor], inverse: list[np.ndarray], numeric: torch.Tensor) -> torch.Tensor:
    """Logits ``[n]``. ``rows_by_table[table_name(f)]`` holds the rows of the unique ids of
    field ``f`` and ``inverse[f]`` (``[n, ids_per_field]``) says which row each id is."""
    n = numeric.shape[0]
    embs = []
    for f in range(shape.fields):
        r = rows_by_table[table_name(f)]
        embs.append(r[torch.as_tensor(inverse[f]).reshape(-1)].reshape(n, shape.ids_per_field, shape.embedding_dim).mean(dim=1))
    x = torch.cat(embs + [numeric], dim=1)
    h = F.relu(x @ dense["l1.w"].T + dense["l1.b"])
    return (h @ dense["l2.w"].T + dense["l2.b"]).reshape(-1)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


def unique_ids(ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per field: the unique ids and, for every id of the batch, its index among them."""
    uniq, inv = [], []
    for f in range(ids.shape[1]):
        u, i = np.unique(ids[:, f, :], return_inverse=True)
        uniq.append(u)
        inv.append(i.reshape(ids.shape[0], ids.shape[2]))
    return uniq, inv


def batch_rows(n_rows: int, batch_size: int, *, seed: int, worker: int, clock: int) -> np.ndarray:
    """Which of a worker's ``n_rows`` rows make its batch at ``clock`` (from (seed, worker, clock) alone)."""
    rng = np.random.default_rng([seed, 17, worker, clock])
    return rng.integers(0, n_rows, size=min(batch_size, n_rows))
