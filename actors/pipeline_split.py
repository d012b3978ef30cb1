"""Layers to pipeline stages: contiguous pieces sized by measured layer cost and node speed.

Pure functions, no Ray. A model is a list of layers with a measured cost each (seconds
of forward plus backward for one micro-batch); a pipeline has stages with a relative
speed each. :func:`split_layers` cuts the layer list into one contiguous piece per
stage so that the slowest stage (its piece's cost divided by its speed) is as fast as
it can be: a stage on a node twice as fast gets about twice the work.

With equal layer costs this is :func:`raylane.placement.split_by_speed` of the layer
count (used as is in that case); with unequal costs (an embedding and a head beside
the transformer blocks) it is the exact min-max contiguous partition, by dynamic
programming over ``len(costs) * len(speeds)`` cut points (a model has tens of layers).

>>> split_layers([1.0] * 6, [1.0, 2.0])
[range(0, 2), range(2, 6)]
"""

from __future__ import annotations

import math
from typing import Sequence

from raylane.placement import split_by_speed


def _check(costs: Sequence[float], speeds: Sequence[float]) -> None:
    if len(speeds) == 0:
        raise ValueError("a pipeline needs at least one stage, got 0 stages")
    if len(speeds) > len(costs):
        raise ValueError(f"{len(speeds)} pipeline stages but the model has only {len(costs)} layers; "
                         f"use at most {len(costs)} stages (stages x chunks for interleaved schedules)")
    bad = [c for c in costs if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"layer costs must be finite and >= 0, got {list(costs)}")
    if any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"stage speeds must be finite and > 0, got {list(speeds)}")


def _ranges(sizes: Sequence[int]) -> list[range]:
    out, at = [], 0
    for n in sizes:
        out.append(range(at, at + n))
        at += n
    return out


def split_layers(costs: Sequence[float], speeds: Sequence[float]) -> list[range]:
    """One contiguous, non-empty range of layer indices per stage, in stage order,
    minimising ``max(sum(costs[r]) / speed)`` over the stages.

    Raises ValueError when there are more stages than layers or no stage at all.
    """
    _check(costs, speeds)
    n, k = len(costs), len(speeds)
    if len(set(costs)) <= 1:
        sizes = split_by_speed(n, speeds)
        if min(sizes) >= 1:
            return _ranges(sizes)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[j][i]: the least max-load placing layers [0, i) on stages [0, j); cut[j][i] the
    # start of stage j-1's piece in that optimum.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):  # leave at least one layer for each later stage
            for a in range(j - 1, i):
                load = max(best[j - 1][a], (prefix[i] - prefix[a]) / speeds[j - 1])
                # ties: prefer the later cut (earlier stages lighter), so equal inputs give one answer
                if load < best[j][i] - 1e-12 or (abs(load - best[j][i]) <= 1e-12 and a > cut[j][i]):
                    best[j][i], cut[j][i] = load, a
    sizes, i = [], n
    for j in range(k, 0, -1):
        a = cut[j][i]
        sizes.append(i - a)
        i = a
    return _ranges(sizes[::-1])


def stage_loads(costs: Sequence[float], speeds: Sequence[float], pieces: Sequence[range]) -> list[float]:
    """Each stage's time per micro-batch: the cost of its piece divided by its speed."""
    return [sum(costs[i] for i in r) / s for r, s in zip(pieces, speeds)]


def split_virtual(costs: Sequence[float], speeds: Sequence[float], chunks: int) -> list[range]:
    """Pieces for ``len(speeds) * chunks`` virtual stages in model order, where virtual
    stage ``j`` runs on stage ``j % len(speeds)`` (the looped placement of the interleaved
    and breadth-first schedules), so it gets that stage's speed."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    p = len(speeds)
    if p == 0:
        raise ValueError("a pipeline needs at least one stage, got 0 stages")
    return split_layers(costs, [speeds[j % p] for j in range(p * chunks)])
