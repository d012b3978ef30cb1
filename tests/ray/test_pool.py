"""Task pool on one local Ray: faults, timeouts, resizing, queued calls."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from raylane.placement import RoleSpec
from raylane.group import TaskPool, CallTimeoutError, PoolError, WorkError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@ray.remote
class Worker:
    def __init__(self, key: int):
        self.key = key
        self.weights = None

    def pid(self) -> int:
        return os.getpid()

    def square(self, x: int, delay: float = 0.1) -> tuple[int, int]:
        time.sleep(delay)
        return x * x, self.key

    def set_weights(self, w) -> int:
        self.weights = w
        return self.key

    def get_weights(self):
        return self.weights

    def hang(self) -> None:
        time.sleep(3600)

    def fail(self, x: int) -> None:
        raise ValueError(f"bad item {x}")


def make_pool(n=3, lo=1, hi=4, **kw) -> TaskPool:
    pool = TaskPool(RoleSpec("worker", {"CPU": 0.5}, min_count=lo, max_count=hi), Worker, actor_args=lambda k: ((k,), {}), size=n, **kw)
    pool.wait_ready(timeout_s=60)
    return pool


def test_map_returns_results_in_order(ray_local):
    pool = make_pool(2)
    try:
        out = pool.map("square", range(7), timeout_s=60)
        assert [r for r, _ in out] == [i * i for i in range(7)]
        assert {k for _, k in out} == {0, 1}  # both actors took work
    finally:
        pool.shutdown()


@pytest.mark.parametrize("queue_depth", [1, 3])
def test_killed_actor_mid_call_every_item_completes_exactly_once(ray_local, queue_depth):
    # With queue_depth 3 the killed actor also held queued calls: they are retried too.
    pool = make_pool(3, call_timeout_s=60, queue_depth=queue_depth)
    try:
        pids = pool.call_all("pid", timeout_s=30)
        tickets = [pool.submit("square", i, 0.3) for i in range(18)]
        killer = threading.Timer(0.5, lambda: os.kill(pids[0], signal.SIGKILL))
        killer.start()
        done = pool.gather(tickets, timeout_s=120)
        killer.join()
        assert sorted(done) == sorted(tickets)  # each ticket exactly once, none missing
        assert [done[t][0] for t in tickets] == [i * i for i in range(18)]
        st = pool.status()
        assert len(st.evictions) == 1 and "died" in st.evictions[0].reason
        pool.wait_ready(timeout_s=60)
        assert pool.status().live == 3  # the replacement is up
        assert len(set(pool.call_all("pid", timeout_s=30)) & {pids[0]}) == 0
    finally:
        pool.shutdown()


def test_hanging_actor_raises_timeout_naming_actor_and_call(ray_local):
    pool = make_pool(2, call_timeout_s=2.0)
    try:
        t0 = time.monotonic()
        ticket = pool.submit("hang")
        with pytest.raises(CallTimeoutError) as info:
            pool.gather([ticket], timeout_s=30)
        elapsed = time.monotonic() - t0
        assert elapsed < 15.0, elapsed  # the 2 s call timeout, not the gather's 30 s deadline
        msg = str(info.value)
        assert "'hang'" in msg and "call_timeout_s=2" in msg and "#" in msg
        # The stuck actor was replaced; the pool still works.
        assert [r for r, _ in pool.map("square", [3], timeout_s=60)] == [9]
    finally:
        pool.shutdown()


def test_gather_deadline_names_unfinished_calls(ray_local):
    pool = make_pool(1, call_timeout_s=60)
    try:
        ticket = pool.submit("square", 2, 5.0)
        with pytest.raises(CallTimeoutError, match="'square'.*running on actor"):
            pool.gather([ticket], timeout_s=1.0)
    finally:
        pool.shutdown()


def test_resize_while_work_in_flight(ray_local):
    pool = make_pool(2)
    try:
        tickets = [pool.submit("square", i, 0.5) for i in range(24)]  # 6 s of work for 2 actors
        pool.resize(4)  # grow mid-flight
        pool.wait_ready(timeout_s=60)  # the new actors are up while most of the work is still queued
        part = pool.gather(tickets[:12], timeout_s=60)
        pool.resize(1)  # shrink mid-flight: retiring actors finish their call first
        rest = pool.gather(tickets[12:], timeout_s=60)
        results = {**part, **rest}
        assert [results[t][0] for t in tickets] == [i * i for i in range(24)]
        assert pool.size == 1
        assert len({k for _, k in results.values()}) >= 3  # grown actors took work
        pool.wait_ready(timeout_s=30)
        assert pool.status().live == 1
    finally:
        pool.shutdown()


def test_method_error_is_grouped_not_retried(ray_local):
    pool = make_pool(2)
    try:
        with pytest.raises(WorkError) as info:
            pool.map("fail", [1, 1], timeout_s=30)
        assert "2 call(s) of 'fail'" in str(info.value) and "bad item 1" in str(info.value)
        assert not pool.status().evictions  # a bug in the method is not a dead actor
    finally:
        pool.shutdown()


def test_bad_sizes_are_refused(ray_local):
    pool = make_pool(1, lo=1, hi=2)
    try:
        for bad in (0, 3, -1, 1.5):
            with pytest.raises(ValueError, match=r"size must be an integer in 1\.\.2"):
                pool.resize(bad)
    finally:
        pool.shutdown()
    with pytest.raises(PoolError, match="shut down"):
        pool.submit("square", 1)


def test_submitted_work_starts_at_once_without_a_gather(ray_local):
    pool = make_pool(2)
    try:
        tickets = [pool.submit("square", i, 1.0) for i in range(2)]
        time.sleep(4.0)  # the calls run meanwhile
        done = pool.gather(tickets, timeout_s=0.9)  # shorter than one call: they ran before the gather
        assert [done[t][0] for t in tickets] == [0, 1]
    finally:
        pool.shutdown()


def test_call_all_require_all_reports_an_actor_that_died(ray_local):
    pool = make_pool(2)
    try:
        pids = pool.call_all("pid", timeout_s=30)
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(PoolError, match="1 actor\\(s\\) died during 'get_weights'") as info:
            pool.call_all("get_weights", timeout_s=30, require_all=True)
        assert info.value.role == "worker"
        pool.wait_ready(timeout_s=60)
        assert len(pool.call_all("get_weights", timeout_s=30, require_all=True)) == 2
    finally:
        pool.shutdown()


def test_gather_with_refs_hands_a_result_on_and_it_outlives_its_maker(ray_local):
    makers, readers = make_pool(2), make_pool(1)
    try:
        t = makers.submit("square", 7, 0.0)
        value, ref = makers.gather([t], timeout_s=60, refs=True)[t]
        assert value[0] == 49 and ray.get(ref, timeout=30) == value
        for pid in makers.call_all("pid", timeout_s=30):
            os.kill(pid, signal.SIGKILL)  # the value held here keeps the result alive
        r = readers.submit("set_weights", ref)
        readers.gather([r], timeout_s=60)
        assert readers.call_all("get_weights", timeout_s=30) == [value]  # the reader got the value, not the ref
        t2 = makers.submit("square", 3, 0.0)
        assert makers.gather([t2], timeout_s=60)[t2][0] == 9  # without refs=True: plain values
    finally:
        makers.shutdown()
        readers.shutdown()


def test_queued_calls_start_in_the_actor_without_the_caller_polling(ray_local):
    pool = make_pool(1, lo=1, queue_depth=3)
    try:
        tickets = [pool.submit("square", i, 1.0) for i in range(3)]
        time.sleep(6.0)  # no pool method runs meanwhile: only calls already at the actor can progress
        done = pool.gather(tickets, timeout_s=0.9)  # shorter than one call
        assert [done[t][0] for t in tickets] == [0, 1, 4]
        flat = make_pool(1, lo=1)  # one call at a time: the second waits for the caller
        try:
            tickets = [flat.submit("square", i, 1.0) for i in range(3)]
            time.sleep(4.0)
            with pytest.raises(CallTimeoutError):
                flat.gather(tickets, timeout_s=0.9)
        finally:
            flat.shutdown()
        with pytest.raises(ValueError, match="queue_depth must be an integer >= 1, got 0"):
            make_pool(1, queue_depth=0)
    finally:
        pool.shutdown()


def test_calls_queued_at_a_killed_actor_without_retry_are_reported_lost(ray_local):
    pool = make_pool(2, call_timeout_s=60, queue_depth=3)
    try:
        pids = pool.call_all("pid", timeout_s=30)  # asked first: a call queues behind those an actor holds
        lost = [pool.submit("square", i, 2.0, retry=False) for i in range(6)]  # 3 held by each actor
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
        got = pool.gather(lost, timeout_s=60, partial=True)
        assert len(got) == len(pool.lost()) == 3, (got, pool.lost())  # the killed actor's running call and the two behind it
    finally:
        pool.shutdown()


@ray.remote
class Ledger:
    """A stateful actor that records, in order, every call it ran."""

    def __init__(self, key: int):
        self.key, self.ran = key, []

    def pid(self) -> int:
        return os.getpid()

    def train(self, x: int, delay: float = 0.2) -> int:
        time.sleep(delay)
        self.ran.append(x)
        return x

    def load(self, ran: list) -> None:
        self.ran = list(ran)

    def history(self) -> list:
        return list(self.ran)


def test_no_call_of_an_abandoned_step_reaches_a_stateful_replacement(ray_local):
    """A stateful actor killed with calls queued for it (in its own queue and in the
    pool's): those calls are lost, not retried on the empty replacement; the pool refuses
    new calls until the state is restored; after abandon() and restored() the replacement
    runs exactly the calls made after the restore."""
    pool = TaskPool(RoleSpec("trainer", {"CPU": 0.5}, count=1, stateful=True), Ledger, actor_args=lambda k: ((k,), {}),
                    size=1, queue_depth=2, call_timeout_s=60)
    try:
        pool.wait_ready(timeout_s=60)
        pid = pool.call_one("pid", timeout_s=30)
        step = [pool.submit("train", x, 2.0, retry=False) for x in range(6)]  # 2 at the actor, 4 in the pool's queue
        first = pool.gather(step[:1], timeout_s=30)
        assert first == {step[0]: 0}
        os.kill(pid, signal.SIGKILL)  # while it runs the step's second call
        with pytest.raises(PoolError):
            pool.gather(step[1:2], timeout_s=30)
        pool.wait_for(1, timeout_s=60)  # the replacement is up, and has run nothing
        with pytest.raises(PoolError, match="stateful role 'trainer' was lost"):
            pool.submit("train", 100)  # before its state is restored
        pool.abandon()  # what the driver does when a step fails
        pool.call_one("load", [0], timeout_s=30)  # the checkpoint
        pool.restored()
        after = [pool.submit("train", x) for x in (10, 11)]
        assert pool.gather(after, timeout_s=30) == {after[0]: 10, after[1]: 11}
        time.sleep(0.5)  # anything of the abandoned step would have run by now
        assert pool.call_one("history", timeout_s=30) == [0, 10, 11]
        with pytest.raises(PoolError, match="abandoned"):
            pool.gather(step[2:], timeout_s=5)
    finally:
        pool.shutdown()


def test_abandon_drops_queued_calls_of_a_stateless_pool(ray_local):
    pool = TaskPool(RoleSpec("trainer", {"CPU": 0.5}, count=1), Ledger, actor_args=lambda k: ((k,), {}), size=1, queue_depth=1, call_timeout_s=60)
    try:
        pool.wait_ready(timeout_s=60)
        dropped = [pool.submit("train", x) for x in range(5)]
        pool.abandon()
        kept = pool.submit("train", 99)
        assert pool.gather([kept], timeout_s=30) == {kept: 99}
        history = pool.call_one("history", timeout_s=30)
        assert history[-1] == 99 and len(history) <= 2, history  # at most the call already running when abandoned
        assert pool.gather(dropped, timeout_s=5, partial=True) == {} and sorted(pool.lost()) == dropped
    finally:
        pool.shutdown()
