"""Gang on one local Ray: ranks, a replacement taking the lost rank through on_join, and
the one gather with a deadline and a grace period."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from raylane.group import CallTimeoutError, Gang, GroupLost, WorkError
from raylane.placement import RoleSpec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@ray.remote
class Ranked:
    def __init__(self):
        self.rank = None

    def join(self, rank: int) -> dict:
        self.rank = rank
        return {"rank": rank, "pid": os.getpid()}

    def who(self) -> int | None:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def work(self, x: int, mode: str = "ok", delay: float = 0.0) -> int:
        time.sleep(delay)
        if mode == "bug":
            raise ValueError("bad input")
        if mode == "peer":
            raise ConnectionResetError("peer left the collective")  # the "broken collective"
        if mode == "hang":
            time.sleep(3600)
        return x * 10 + self.rank


def make_gang(n: int = 3, **kw) -> Gang:
    role = RoleSpec("ranked", {"CPU": 0.25}, count=n, stateful=True)
    return Gang(role, Ranked, on_join=lambda rank, h: h.join.remote(rank), rank_name="part", **kw)


def test_form_gives_every_rank_its_identity_and_call_gathers_them(ray_local):
    gang = make_gang()
    try:
        joined = gang.form(timeout_s=60)
        assert sorted(joined) == [0, 1, 2] and all(joined[r]["rank"] == r for r in joined)
        assert gang.form(timeout_s=60) == {}  # nothing missing: nobody joins again
        out = gang.call("work", timeout_s=60, grace_s=5, per_rank=lambda r: ((r,), {}))
        assert out == {0: 0, 1: 11, 2: 22}
        assert set(gang.nodes()) == {0, 1, 2}
    finally:
        gang.shutdown()


def test_a_replacement_takes_the_lost_rank_and_survivors_keep_theirs(ray_local):
    gang = make_gang()
    try:
        pids = {r: v["pid"] for r, v in gang.form(timeout_s=60).items()}
        before = gang.handles()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(GroupLost) as info:
            gang.call("work", 1, timeout_s=60, grace_s=5)
        assert info.value.ranks == (1,) and "part 1: actor lost" in str(info.value) and info.value.role == "ranked"
        joined = gang.form(timeout_s=60)
        assert sorted(joined) == [1] and joined[1]["pid"] != pids[1]
        after = gang.handles()
        assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
        assert ray.get(after[1].who.remote(), timeout=30) == 1
        assert [e.reason for e in gang.status().evictions] == ["lost during 'work': ActorDiedError"]
    finally:
        gang.shutdown()


def test_a_bug_is_one_grouped_work_error_and_kills_nobody(ray_local):
    gang = make_gang()
    try:
        gang.form(timeout_s=60)
        with pytest.raises(WorkError) as info:
            gang.call("work", 1, "bug", timeout_s=60, grace_s=5)
        assert {k: sorted(v) for k, v in info.value.errors.items()} == {"ValueError: bad input": ["part 0", "part 1", "part 2"]}  # grouped
        assert gang.missing() == [] and gang.status().evictions == ()
    finally:
        gang.shutdown()


def test_a_broken_collective_is_group_lost_and_a_rank_left_inside_is_killed_after_the_grace(ray_local):
    gang = make_gang(broken=lambda exc: isinstance(exc, ConnectionResetError))
    try:
        gang.form(timeout_s=60)
        h = gang.handles()
        calls = {0: h[0].work.remote(0, "peer"), 1: h[1].work.remote(1, "peer", 0.5), 2: h[2].work.remote(2, "hang")}
        t0 = time.monotonic()
        with pytest.raises(GroupLost) as info:
            gang.gather(calls, what="work", timeout_s=120, grace_s=3)
        assert time.monotonic() - t0 < 60  # the grace period, not the deadline
        text = str(info.value)
        assert "part 0: ConnectionResetError: peer left the collective" in text and "part 2: still in the collective 3 s after the first failure, killed" in text
        assert info.value.ranks == (2,)
        assert gang.missing() == [2]  # the stuck rank was evicted; form() fills it
        assert sorted(gang.form(timeout_s=60)) == [2]
    finally:
        gang.shutdown()


def test_a_deadline_with_no_failure_is_a_timeout_naming_the_ranks(ray_local):
    gang = make_gang(n=2)
    try:
        gang.form(timeout_s=60)
        h = gang.handles()
        with pytest.raises(CallTimeoutError, match=r"'work' on part\(s\) \[1\] did not return within 2 s"):
            gang.gather({0: h[0].work.remote(0), 1: h[1].work.remote(1, "hang")}, what="work", timeout_s=2, grace_s=1)
        assert gang.missing() == [1]
    finally:
        gang.shutdown()


def test_a_gang_keeps_its_size(ray_local):
    gang = make_gang(n=2)
    try:
        gang.resize(2)
        with pytest.raises(ValueError, match="gang of 2 ranks"):
            gang.resize(3)
    finally:
        gang.shutdown()


def test_an_elastic_gang_deals_its_ranks_over_the_live_actors_and_may_be_resized(ray_local):
    role = RoleSpec("ranked", {"CPU": 0.25}, min_count=1, max_count=3, stateful=True)
    gang = Gang(role, Ranked, size=3, elastic=True, rank_name="stage")
    try:
        gang.wait_ready(timeout_s=60)
        live = gang.actors()
        ray.get([h.join.remote(i) for i, h in enumerate(live)], timeout=60)
        gang.deal([live[2], live[0]])  # the workload cut its work over two of them, in this order
        assert gang.width == 2 and gang.handles() == {0: live[2], 1: live[0]}
        out = gang.gather({r: [h.work.remote(1), h.work.remote(2)] for r, h in gang.handles().items()}, what="work", timeout_s=60, grace_s=5)
        assert out == {0: [12, 22], 1: [10, 20]}  # a rank's list of calls answers as a list, in order
        gang.resize(2)
        gang.wait_ready(timeout_s=60)
        assert gang.target == 2 and len(gang.actors()) == 2
        with pytest.raises(ValueError, match="1..3"):
            gang.resize(4)
        fixed = make_gang(n=1)
        with pytest.raises(ValueError, match="elastic"):
            fixed.deal(fixed.actors())
        fixed.shutdown()
    finally:
        gang.shutdown()


def test_a_result_passed_from_a_dead_peer_fails_that_rank_without_evicting_it(ray_local):
    gang = make_gang(n=2)
    try:
        pids = {r: v["pid"] for r, v in gang.form(timeout_s=60).items()}
        h = gang.handles()
        first = h[0].work.remote(0, "ok", 30.0)  # rank 0 is still working when it dies
        calls = {0: first, 1: h[1].work.remote(first)}  # rank 1 is handed rank 0's result
        time.sleep(1.0)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(GroupLost) as info:
            gang.gather(calls, what="work", timeout_s=60, grace_s=5)
        assert info.value.ranks == (0,) and "part 1: PeerLost" in str(info.value), str(info.value)
        assert gang.missing() == [0]  # only the dead rank is evicted; rank 1 keeps its actor
        assert gang.handles()[1] == h[1]
    finally:
        gang.shutdown()


def test_a_hot_spare_takes_the_lost_rank_and_a_new_spare_starts(ray_local):
    gang = make_gang(2, spares=1)
    try:
        pids = {r: v["pid"] for r, v in gang.form(timeout_s=60).items()}
        assert sorted(pids) == [0, 1] and gang.width == 2
        gang.wait_for(3, timeout_s=60)  # the spare too
        ranked = set(map(id, gang.handles().values()))
        spares = [h for h in gang.actors() if id(h) not in ranked]
        assert len(spares) == 1
        spare_pid = ray.get(spares[0].pid.remote(), timeout=30)
        assert spare_pid not in pids.values() and ray.get(spares[0].who.remote(), timeout=30) is None
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(GroupLost):
            gang.call("work", 1, timeout_s=60, grace_s=5)
        joined = gang.form(timeout_s=60)
        assert sorted(joined) == [1] and joined[1]["pid"] == spare_pid  # the running spare, not a new actor
        assert gang.call("work", 1, timeout_s=60, grace_s=5) == {0: 10, 1: 11}
        gang.wait_for(3, timeout_s=60)  # a new spare started in the background
        assert len(gang.actors()) == 3 and len(gang.handles()) == 2
        with pytest.raises(ValueError, match="gang of 2 ranks"):
            gang.resize(3)
    finally:
        gang.shutdown()


def test_spares_below_zero_are_refused_naming_the_value():
    role = RoleSpec("ranked", {"CPU": 0.25}, count=2, stateful=True)
    with pytest.raises(ValueError, match="spares=-1: use a whole number, 0 or more"):
        Gang(role, Ranked, spares=-1)
