"""raylane.actors.pipeline_split: contiguous layer pieces by cost and speed, without Ray."""

from __future__ import annotations

import itertools
import random

import pytest

from raylane.actors.pipeline_split import split_layers, split_virtual, stage_loads
from raylane.placement import split_by_speed

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def brute(costs, speeds):
    """The least max-load over every contiguous split (small inputs only)."""
    n, k = len(costs), len(speeds)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        pieces = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        load = max(stage_loads(costs, speeds, pieces))
        best = load if best is None else min(best, load)
    return best


def covers(pieces, n):
    return [i for r in pieces for i in r] == list(range(n)) and all(len(r) >= 1 for r in pieces)


def test_a_stage_twice_as_fast_gets_twice_the_work():
    assert split_layers([1.0] * 12, [1.0, 2.0]) == [range(0, 4), range(4, 12)]
    pieces = split_layers([0.3] + [1.0] * 11 + [0.7], [2.0, 1.0])
    loads = stage_loads([0.3] + [1.0] * 11 + [0.7], [2.0, 1.0], pieces)
    work = [sum(([0.3] + [1.0] * 11 + [0.7])[i] for i in r) for r in pieces]
    assert work[0] / work[1] == pytest.approx(2.0, rel=0.25) and max(loads) <= 4.5


def test_equal_costs_follow_split_by_speed():
    for speeds in ([1, 1, 1], [1, 2, 3], [3.0, 1.0], [1, 1, 1, 1, 1]):
        pieces = split_layers([2.0] * 10, speeds)
        assert [len(r) for r in pieces] == split_by_speed(10, speeds)


def test_unequal_costs_reach_the_optimum():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.1, 0.5, 1.0, 2.0, rng.random()]) for _ in range(n)]
        speeds = [rng.choice([1.0, 2.0, 0.5]) for _ in range(k)]
        pieces = split_layers(costs, speeds)
        assert covers(pieces, n) and len(pieces) == k
        assert max(stage_loads(costs, speeds, pieces)) == pytest.approx(brute(costs, speeds))


def test_virtual_stages_take_their_stages_speed():
    pieces = split_virtual([1.0] * 12, [1.0, 2.0], chunks=2)
    assert [len(r) for r in pieces] == [2, 4, 2, 4]
    assert covers(pieces, 12)


def test_more_stages_than_layers_is_an_error_naming_both():
    with pytest.raises(ValueError, match="5 pipeline stages but the model has only 4 layers; use at most 4"):
        split_layers([1.0] * 4, [1.0] * 5)
    with pytest.raises(ValueError, match="8 pipeline stages but the model has only 6 layers"):
        split_virtual([1.0] * 6, [1.0] * 4, chunks=2)


def test_zero_stages_and_bad_numbers_are_errors():
    with pytest.raises(ValueError, match="at least one stage, got 0 stages"):
        split_layers([1.0, 1.0], [])
    with pytest.raises(ValueError, match="stage speeds must be finite and > 0"):
        split_layers([1.0, 1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="layer costs must be finite and >= 0"):
        split_layers([1.0, float("nan")], [1.0])
    with pytest.raises(ValueError, match="chunks must be >= 1, got 0"):
        split_virtual([1.0] * 4, [1.0], chunks=0)
