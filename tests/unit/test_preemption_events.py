"""raylane.preemption.diff and the event classes (pure; no Ray, no monitor)."""

from __future__ import annotations

import pytest

from raylane.preemption import NodeJoined, NodeLeaving, NodeLost, NodeState, diff

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def st(node_id, market="spot", alive=True, draining=False, deadline=None) -> NodeState:
    return NodeState(node_id=node_id, market=market, alive=alive, draining=draining, deadline=deadline)


def test_no_events_for_unchanged_states():
    states = [st("a"), st("b", "on-demand"), st("c", draining=True, deadline=50.0), st("d", alive=False)]
    assert diff(states, list(states)) == []
    assert diff([], []) == []


def test_join():
    assert diff([st("a")], [st("a"), st("b", "on-demand")]) == [NodeJoined("b", "on-demand")]
    assert diff([], [st("x")]) == [NodeJoined("x", "spot")]


def test_first_seen_dead_is_not_a_join():
    assert diff([], [st("x", alive=False)]) == []


def test_leave_carries_deadline():
    events = diff([st("a"), st("b")], [st("a", draining=True, deadline=1234.5), st("b")])
    assert events == [NodeLeaving("a", "spot", 1234.5)]
    assert events[0].deadline == 1234.5


def test_leave_without_deadline():
    assert diff([st("a", "on-demand")], [st("a", "on-demand", draining=True)]) == [NodeLeaving("a", "on-demand", None)]


def test_leaving_reported_once():
    before = [st("a", draining=True, deadline=10.0)]
    assert diff(before, [st("a", draining=True, deadline=12.0)]) == []


def test_lost_when_turned_dead():
    assert diff([st("a"), st("b")], [st("a", alive=False), st("b")]) == [NodeLost("a", "spot")]
    # draining, then dead: lost only (leaving was reported before)
    assert diff([st("a", draining=True, deadline=5.0)], [st("a", alive=False, draining=True)]) == [NodeLost("a", "spot")]


def test_lost_when_vanished_from_table():
    assert diff([st("a", "on-demand"), st("b")], [st("b")]) == [NodeLost("a", "on-demand")]
    # a node already dead that then vanishes is not lost twice
    assert diff([st("a", alive=False)], []) == []


def test_first_seen_draining_yields_join_then_leaving():
    assert diff([], [st("n", draining=True, deadline=99.0)]) == [NodeJoined("n", "spot"), NodeLeaving("n", "spot", 99.0)]


def test_mixed_changes():
    before = [st("a"), st("b"), st("c")]
    after = [st("a", draining=True, deadline=7.0), st("b", alive=False), st("d", "on-demand")]
    events = diff(before, after)
    assert sorted(events, key=repr) == sorted(
        [NodeLeaving("a", "spot", 7.0), NodeLost("b", "spot"), NodeJoined("d", "on-demand"), NodeLost("c", "spot")], key=repr
    )
    assert len(events) == 4


def test_diff_accepts_generators():
    assert diff((s for s in [st("a")]), (s for s in [])) == [NodeLost("a", "spot")]


def test_seconds_left():
    e = NodeLeaving("a", "spot", 100.0)
    assert e.seconds_left(now=40.0) == 60.0
    assert e.seconds_left(now=130.0) == -30.0
    assert NodeLeaving("a", "spot", None).seconds_left(now=40.0) is None


def test_seconds_left_defaults_to_wall_clock():
    import time

    e = NodeLeaving("a", "spot", time.time() + 30.0)
    left = e.seconds_left()
    assert 25.0 < left <= 30.0


def test_seconds_left_with_now_zero():
    assert NodeLeaving("a", "spot", 100.0).seconds_left(now=0.0) == 100.0


def test_random_spot_schedule_is_seeded_and_well_formed():
    from raylane.testing.spotmarket import random_schedule

    a = random_schedule(7, events=6, every_s=10.0, notice_s=30.0, notice_share=0.5)
    assert a == random_schedule(7, events=6, every_s=10.0, notice_s=30.0, notice_share=0.5)
    assert a != random_schedule(8, events=6, every_s=10.0, notice_s=30.0, notice_share=0.5)
    times = [e.at for e in a]
    assert times == sorted(times) and all(7.5 <= b - t <= 12.5 for t, b in zip([0.0] + times, times))
    assert {e.action for e in a} <= {"preempt", "remove"}
    assert all((e.notice_s == 30.0) == (e.action == "preempt") for e in a)
    with pytest.raises(ValueError, match="every_s"):
        random_schedule(0, events=1, every_s=0)
