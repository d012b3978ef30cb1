"""Where parameters live in a sharded parameter server, and how embedding rows start.

Pure functions, no Ray. Dense tensors are split as flat ranges, every tensor over every
shard in contiguous, balanced pieces (so each shard holds about ``1/shards`` of each
tensor and of the whole). Embedding rows go to ``hash(table, id) % shards`` with a
fixed mixing function (Python's ``hash`` of a string changes between processes), and a
row's initial value depends only on (seed, table, id), so whichever shard creates it on
first touch, and whenever, it starts the same.

>>> dense_slices({"w": 10, "b": 3}, 2)
[{'w': (0, 5), 'b': (0, 1)}, {'w': (5, 10), 'b': (1, 3)}]
"""

from __future__ import annotations

import zlib
from typing import Mapping

import numpy as np

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def check_shards(shards: int) -> None:
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards must be a whole number >= 1, got {shards!r}")


def dense_slices(sizes: Mapping[str, int], shards: int) -> list[dict[str, tuple[int, int]]]:
    """Per shard: ``{tensor name: (start, stop)}`` of its flat range of every tensor (a
    tensor smaller than ``shards`` leaves some shards an empty range of it)."""
    check_shards(shards)
    out: list[dict[str, tuple[int, int]]] = [{} for _ in range(shards)]
    for name, n in sizes.items():
        if n < 0:
            raise ValueError(f"tensor {name!r} has a negative size {n}")
        bounds = [(n * k) // shards for k in range(shards + 1)]
        for k in range(shards):
            out[k][name] = (bounds[k], bounds[k + 1])
    return out


def check_ids(table: str, ids: object) -> np.ndarray:
    """Embedding row ids as int64; anything but whole numbers is refused, naming the table."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"table {table!r}: feature ids must be integers, got dtype {arr.dtype} (e.g. {arr.reshape(-1)[:3].tolist()}); "
                        "hash string or float features to integer ids first")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"table {table!r}: feature ids must fit in int64")
    return arr.astype(np.int64, copy=False).reshape(-1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-spread 64-bit hash (vectorised)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def table_salt(table: str) -> np.uint64:
    return np.uint64(zlib.crc32(table.encode()))


def row_shard(table: str, ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard of each row id of ``table``."""
    check_shards(shards)
    with np.errstate(over="ignore"):
        h = _mix(ids.astype(np.uint64) ^ (table_salt(table) << np.uint64(32)))
    return (h % np.uint64(shards)).astype(np.int64)


def init_rows(seed: int, table: str, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """Initial values of rows ``ids`` of ``table``: uniform in [-scale, scale), from (seed,
    table, id, column) alone."""
    with np.errstate(over="ignore"):
        base = _mix(ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ table_salt(table) ^ (np.uint64(seed) << np.uint64(40)))
        cols = np.arange(dim, dtype=np.uint64)
        h = _mix(base[:, None] + cols[None, :] * np.uint64(0xD1B54A32D192ED03))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return ((2.0 * u - 1.0) * scale).astype(np.float32)
