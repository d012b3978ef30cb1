"""Multi-hop neighbour sampling on a CSR graph, vectorised in numpy (pure functions).

Written here rather than taken from PyG: its ``NeighborLoader`` needs pyg-lib or
torch-sparse, which are not installable from the package index for every platform, and
its distributed sampler is deprecated. The algorithm is the standard GraphSAGE one:
hop 1 samples up to ``fanouts[0]`` in-neighbours of every seed, hop ``h`` samples up to
``fanouts[h-1]`` in-neighbours of the nodes that hop ``h-1`` added, all without
replacement. A few vectorised numpy passes per hop (one per sampled neighbour for the
nodes with more neighbours than the fan-out, see :func:`sample_offsets`), never a
Python loop per node.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def check_fanouts(fanouts: Sequence[int]) -> tuple[int, ...]:
    """The fan-outs as a tuple; a clear error for an empty list or a value below 1."""
    fanouts = tuple(int(f) for f in fanouts)
    if not fanouts:
        raise ValueError("fanouts is empty: give one positive fan-out per GNN layer, e.g. [15, 10]")
    bad = [f for f in fanouts if f < 1]
    if bad:
        raise ValueError(f"fanouts {list(fanouts)} holds {bad[0]}: every fan-out must be >= 1 (neighbours sampled per node per layer)")
    return fanouts


def sample_subgraph(
    indptr: np.ndarray,
    indices: np.ndarray,
    seeds: np.ndarray,
    fanouts: Sequence[int],
    rng: np.random.Generator,
    scratch: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Sample the ``len(fanouts)``-hop neighbourhood of ``seeds``.

    Returns ``n_id`` (global ids of the sampled nodes, seeds first, no duplicates; int32
    below 2^31 nodes),
    ``edge_index`` ([2, E] int32 local ids: row 0 the neighbour, row 1 the node that
    aggregates it, PyG's source-to-target order), ``num_sampled_nodes`` (nodes added per
    hop, seeds first) and ``num_sampled_edges`` (edges per hop). ``scratch`` is an int64
    array of length num_nodes filled with -1 (reused between calls to avoid allocating
    it per batch; it is left filled with -1 again).
    """
    num_nodes = indptr.shape[0] - 1
    seeds = np.asarray(seeds, dtype=np.int64)
    local = np.full(num_nodes, -1, dtype=np.int64) if scratch is None else scratch
    if len(np.unique(seeds)) != len(seeds):
        raise ValueError("seeds contain duplicates")
    local[seeds] = np.arange(len(seeds))
    parts, srcs, dsts = [seeds], [], []
    dirty = []  # entries of `local` written outside `parts`, reset on the way out
    n_nodes, edges_per_hop = [len(seeds)], []
    frontier, total = seeds, len(seeds)
    try:
        for fan in fanouts:
            start = indptr[frontier]
            rows, offsets = sample_offsets(indptr[frontier + 1] - start, fan, rng)
            if len(rows) == 0:
                n_nodes.append(0)
                edges_per_hop.append(0)
                frontier = frontier[:0]
                continue
            nbr = indices[start[rows] + offsets]
            new = first_seen(nbr[local[nbr] < 0], local, dirty)
            local[new] = np.arange(total, total + len(new))
            total += len(new)
            srcs.append(local[nbr])
            dsts.append(local[frontier[rows]])
            parts.append(new)
            n_nodes.append(len(new))
            edges_per_hop.append(len(nbr))
            frontier = new
        n_id = np.concatenate(parts)
    finally:
        for p in parts + dirty:
            local[p] = -1
    # Local ids fit in int32 (a batch never holds 2^31 nodes), and so do global ids of a
    # graph under 2^31 nodes: half the bytes to ship.
    edge_index = np.stack([np.concatenate(srcs), np.concatenate(dsts)]).astype(np.int32) if srcs else np.zeros((2, 0), dtype=np.int32)
    if num_nodes < 2**31:
        n_id = n_id.astype(np.int32)
    return {
        "n_id": n_id,
        "edge_index": edge_index,
        "num_sampled_nodes": np.asarray(n_nodes, dtype=np.int64),
        "num_sampled_edges": np.asarray(edges_per_hop, dtype=np.int64),
    }


def sample_offsets(deg: np.ndarray, fan: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """For every row ``i`` with ``deg[i]`` candidates, ``min(deg[i], fan)`` distinct offsets
    in ``[0, deg[i])``, a uniform sample without replacement. Returns ``(rows, offsets)``,
    one entry per sampled edge.

    Rows with at most ``fan`` candidates take them all. The others run Floyd's algorithm
    in lock-step: ``fan`` vectorised steps over all such rows (step ``s`` draws ``t`` in
    ``[0, d - fan + s]`` and keeps ``t``, or ``d - fan + s`` when ``t`` is already
    taken), which gives every ``fan``-subset the same probability. Its cost grows with
    rows x fan^2, not with the candidates: against random keys sorted per row it does
    not touch the ~20 candidates of every row it will not take."""
    deg = np.asarray(deg, dtype=np.int64)
    full = np.flatnonzero(deg <= fan)
    big = np.flatnonzero(deg > fan)
    d_full = deg[full]
    rows_full = np.repeat(full, d_full)
    seg_start = np.cumsum(d_full) - d_full
    off_full = np.arange(len(rows_full)) - np.repeat(seg_start, d_full)
    if len(big) == 0:
        return rows_full, off_full
    d = deg[big]
    picked = np.empty((fan, len(big)), dtype=np.int64)  # one row per step: contiguous compares
    taken = np.empty(len(big), dtype=bool)
    for step in range(fan):
        j = d - fan + step
        t = rng.integers(0, j + 1)
        taken[:] = False
        for earlier in picked[:step]:
            taken |= earlier == t
        picked[step] = np.where(taken, j, t)
    return np.concatenate([rows_full, np.tile(big, fan)]), np.concatenate([off_full, picked.ravel()])


def first_seen(nodes: np.ndarray, scratch: np.ndarray, dirty: list) -> np.ndarray:
    """The distinct values of ``nodes`` (each once, in a fixed order for the same input)
    without sorting: every value's slot in ``scratch`` takes the position of one of its
    occurrences, and the occurrences that find their own position there are kept. The
    slots written are appended to ``dirty`` for the caller to reset. Linear, where
    ``np.unique`` sorts."""
    pos = np.arange(len(nodes))
    dirty.append(nodes)
    scratch[nodes] = pos
    return nodes[scratch[nodes] == pos]


# ----------------------------------------------------------------------------- epochs


def batches_per_part(seed_counts: Sequence[int], batch_size: int) -> list[int]:
    return [math.ceil(c / batch_size) for c in seed_counts]


def epoch_plan(seed_counts: Sequence[int], batch_size: int) -> list[tuple[int, int]]:
    """The epoch's batches as ``(part, index)`` pairs, the parts interleaved round-robin so
    every sampler has work at any point of the epoch. The same for every epoch."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    per = batches_per_part(seed_counts, batch_size)
    out = []
    for i in range(max(per, default=0)):
        out.extend((p, i) for p, n in enumerate(per) if i < n)
    return out


def batch_seeds(part_seeds: np.ndarray, *, seed: int, epoch: int, part: int, index: int, batch_size: int) -> np.ndarray:
    """Seeds of batch ``index`` of ``part`` in ``epoch``: a slice of the part's seeds in an
    order drawn from (seed, epoch, part), so any sampler, a replacement included, produces
    the same batch, and one epoch's batches of a part cover its seeds exactly once."""
    perm = np.random.default_rng([seed, epoch, part]).permutation(len(part_seeds))
    return part_seeds[perm[index * batch_size : (index + 1) * batch_size]]


def batch_rng(*, seed: int, epoch: int, part: int, index: int) -> np.random.Generator:
    """The neighbour-sampling randomness of one batch (deterministic, so a batch redone
    after a lost sampler is the batch the lost one would have produced)."""
    return np.random.default_rng([seed, epoch, part, index, 1])
