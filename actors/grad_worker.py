"""Gradient workers: stateless actors that compute least-squares gradients on row ranges.

The smallest actor kind: it backs the ``linreg`` job that checks a cluster and the
platform end to end (pools, faults, resume, scaling) in seconds. A worker generates
the rows it is asked for itself (deterministically, from the seed and the row
range), so the driver never ships data and any worker can serve any shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import ray

BLOCK = 4096  # rows per generated block; any row range is built from whole blocks


@dataclass(frozen=True)
class GradWorkerConfig:
    """The data a gradient worker can generate."""

    seed: int
    """Seed of the synthetic problem (true weights and every row)."""
    features: int
    """Number of features."""
    noise: float
    """Standard deviation of the label noise."""


def true_weights(seed: int, features: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).normal(size=features)


def rows(cfg: GradWorkerConfig, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [start, stop) of the synthetic problem: X (n, features) and y (n,)."""
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    w = true_weights(cfg.seed, cfg.features)
    xs, ys = [], []
    for b in range(start // BLOCK, (stop + BLOCK - 1) // BLOCK):
        rng = np.random.default_rng([cfg.seed, 1, b])
        x = rng.normal(size=(BLOCK, cfg.features))
        y = x @ w + cfg.noise * rng.normal(size=BLOCK)
        lo, hi = max(start - b * BLOCK, 0), min(stop - b * BLOCK, BLOCK)
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    if not xs:
        return np.zeros((0, cfg.features)), np.zeros(0)
    return np.concatenate(xs), np.concatenate(ys)


@ray.remote
class GradWorker:
    """Lives on any node (stateless role: prefers spot). Holds only a cache of generated
    rows; losing it loses nothing but the call in flight, which the pool retries."""

    def __init__(self, cfg: GradWorkerConfig):
        self.cfg = cfg
        self._rows = lru_cache(maxsize=16)(lambda start, stop: rows(cfg, start, stop))

    def grad(self, w: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, float, int]:
        """Sum of squared-error gradients and losses over rows [start, stop)."""
        x, y = self._rows(start, stop)
        r = x @ w - y
        return x.T @ r, float(r @ r), len(y)
