"""raylane.actors.pipeline_schedules: every schedule's order, completeness, memory and bubble, without Ray."""

from __future__ import annotations

import itertools

import pytest

from raylane.actors import pipeline_schedules as S

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CASES = [
    (name, p, m, v)
    for name in S.SCHEDULES
    for p, m, v in [(1, 1, 1), (2, 2, 1), (2, 4, 1), (3, 6, 1), (4, 8, 1), (4, 12, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 8, 4), (4, 4, 2)]
    if (name in S.LOOPED or v == 1) and not (name == "interleaved" and m % p)
]


def ids(case):
    return "{}-p{}-m{}-v{}".format(*case)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_each_microbatch_is_forwarded_and_backwarded_once_per_chunk_then_one_step(case):
    sched = S.make(*case)
    name, p, m, v = case
    assert len(sched.ops) == p
    for ops in sched.ops:
        fwd = [(o.mb, o.chunk) for o in ops if o.kind == "F"]
        bwd = [(o.mb, o.chunk) for o in ops if o.kind == "B"]
        every = sorted(itertools.product(range(m), range(v)))
        assert sorted(fwd) == every and sorted(bwd) == every
        assert ops[-1] == S.Op("S") and sum(o.kind == "S" for o in ops) == 1


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_dependency_order_holds_in_time_and_in_the_submission_order(case):
    sched = S.make(*case)
    tl = S.simulate(sched)
    for (s, op), t0 in tl.start.items():
        for d in S.deps(sched, s, op):
            assert tl.end[d] <= t0, (s, op, d)
        if op.kind == "B":  # a chunk's backward runs on its own stage after its forward
            assert sched.ops[s].index(S.Op("F", op.mb, op.chunk)) < sched.ops[s].index(op)
    order = S.submission_order(sched)
    seen = set()
    for s, op in order:
        assert all(d in seen for d in S.deps(sched, s, op)), (s, op)
        seen.add((s, op))
    for s in range(sched.p):  # each stage's own order is kept
        assert [op for st, op in order if st == s] == list(sched.ops[s])


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_bubble_fraction_matches_theory(case):
    name, p, m, v = case
    sched = S.make(*case)
    for t_fwd, t_bwd in ((1.0, 1.0), (1.0, 2.0), (0.5, 1.7)):
        assert S.simulate(sched, t_fwd, t_bwd).bubble == pytest.approx(S.bubble_theory(name, p, m, v), abs=1e-9)


def test_bubble_theory_formulas():
    assert S.bubble_theory("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert S.bubble_theory("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert S.bubble_theory("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert S.bubble_theory("bfs", 2, 8, 4) == pytest.approx(1 / 33)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 12)])
def test_peak_live_activations(p, m):
    assert S.peak_activations(S.gpipe(p, m)) == [m] * p
    ofob = S.peak_activations(S.one_f_one_b(p, m))
    assert ofob == [p - s for s in range(p)] and max(ofob) <= p
    assert S.peak_activations(S.breadth_first(p, m, 2)) == [2 * m] * p


def test_interleaved_warms_up_with_megatrons_count():
    sched = S.interleaved_1f1b(4, 8, 2)
    for s, ops in enumerate(sched.ops):
        warm = next(i for i, o in enumerate(ops) if o.kind == "B")
        assert warm == 2 * (4 - s - 1) + 4 + 1  # warm-up forwards, then the first steady forward
    assert S.peak_activations(sched) == [11, 9, 7, 5]


def test_simulate_names_a_deadlock():
    good = S.gpipe(2, 2)
    swapped = (good.ops[0], (S.Op("B", 0), S.Op("F", 0), S.Op("F", 1), S.Op("B", 1), S.Op("S")))
    with pytest.raises(ValueError, match="deadlock.*stage 1: B0"):
        S.simulate(S.Schedule("bad", 2, 2, 1, swapped))


def test_validate_refuses_a_missing_backward():
    ops = (S.Op("F", 0), S.Op("F", 1), S.Op("B", 0), S.Op("S"))
    with pytest.raises(ValueError, match="stage 0 runs 3 F/B ops"):
        S.validate(S.Schedule("bad", 1, 2, 1, (ops,)))


def test_unknown_schedule_name_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown schedule '1fb1'\. Did you mean '1f1b'\?.*gpipe, 1f1b, interleaved, bfs"):
        S.make("1fb1", 2, 4)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="stages must be a whole number >= 1, got 0"):
        S.make("gpipe", 0, 4)
    with pytest.raises(ValueError, match="micro-batches m=2 < stages p=4"):
        S.make("1f1b", 4, 2)
    with pytest.raises(ValueError, match="m=6 must be a multiple of stages p=4.*valid m: 4, 8, 12"):
        S.make("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="chunks v=2 applies only to the looped schedules"):
        S.make("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="chunks must be a whole number >= 1, got 0"):
        S.make("bfs", 2, 4, 0)


def test_docstring_example():
    assert [str(o) for o in S.one_f_one_b(2, 3).ops[0]] == ["F0", "F1", "B0", "F2", "B1", "B2", "S"]
    assert [str(o) for o in S.breadth_first(2, 2, 2).ops[0]] == ["F0", "F1", "F0.1", "F1.1", "B0.1", "B1.1", "B0", "B1", "S"]
