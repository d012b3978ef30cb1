"""Checkpoint parts on real actors: the snapshot is the stall, the actors write their parts
while the run goes on, the manifest commits once every part is written, and a part whose
actor was lost drops the checkpoint (the previous one stays the newest)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from raylane import checkpoint_parts
from raylane.checkpoint import CheckpointStore
from raylane.checkpoint_cadence import Checkpointer, CheckpointPolicy
from raylane.checkpoint_format import PartRef, StoredPart
from raylane.checkpoint_parts import CHECKPOINT_GROUPS, CheckpointParts
from raylane.replicas import InMemory, Keepers, ReplicaKeeper
from raylane.runlog import RunLog, read_jsonl

from harness import gone  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180), pytest.mark.usefixtures("ray_local")]


@ray.remote(concurrency_groups=CHECKPOINT_GROUPS)
class Holder(CheckpointParts):
    def __init__(self, n: int, value: float):
        self.w = np.full(n, value, np.float32)

    def export_state(self) -> dict:
        return {"w": self.w.copy()}

    def import_state(self, state) -> None:
        self.w = np.asarray(state["w"], np.float32).copy()

    def add(self, x: float) -> float:
        self.w += x
        return float(self.w[0])

    def first(self) -> float:
        return float(self.w[0])

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)  # a long step in the actor's main thread (a learner's update, a stage's batch)


def setup(tmp_path):
    log = RunLog(tmp_path / "run", tensorboard=False)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    return Checkpointer(store, CheckpointPolicy(every_steps=1), log), store, log


def test_parts_are_written_by_the_actors_after_the_snapshot_and_committed_later(tmp_path):
    ckpt, store, log = setup(tmp_path)
    actors = {str(i): Holder.remote(1 << 18, float(i)) for i in range(3)}  # 1 MiB each
    assert ckpt.maybe(1, lambda: {"workload": {"held": checkpoint_parts.snapshot(actors, timeout_s=60), "note": "x"}}) is None
    assert ckpt.in_flight is not None and store.steps() == []  # written in the background
    # The next step changes the actors' state while their parts are written.
    assert ray.get([a.add.remote(10.0) for a in actors.values()], timeout=60) == [10.0, 11.0, 12.0]
    info = ckpt.settle(wait=True)
    assert info is not None and info.step == 1 and store.steps() == [1]
    _, state = store.load()
    held = state["workload"]["held"]
    assert all(isinstance(p, StoredPart) for p in held.values()) and state["workload"]["note"] == "x"
    # Restored from the snapshot (the values at the step boundary), each actor reading its own part.
    ray.get([actors[k].load_part.remote(held[k]) for k in actors], timeout=60)
    assert ray.get([a.first.remote() for a in actors.values()], timeout=60) == [0.0, 1.0, 2.0]
    log.close()
    [event] = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint"]
    assert event["parts"] == 3 and event["nbytes"] == 3 << 20 and event["seconds"] <= event["persist_s"]


def test_a_part_whose_actor_is_lost_drops_the_checkpoint_and_the_previous_stays_newest(tmp_path):
    ckpt, store, log = setup(tmp_path)
    actors = {"0": Holder.remote(16, 1.0), "1": Holder.remote(16, 2.0)}
    ckpt.maybe(1, lambda: {"held": checkpoint_parts.snapshot(actors, timeout_s=60)}, force="first")
    assert store.steps() == [1]  # a forced checkpoint is waited for

    def snapshot_then_lose_one():
        parts = checkpoint_parts.snapshot(actors, timeout_s=60)
        ray.kill(actors["1"], no_restart=True)  # gone before it wrote its part
        gone(actors["1"])
        return {"held": parts}

    ckpt.maybe(2, snapshot_then_lose_one)
    assert ckpt.settle(wait=True) is None and ckpt.in_flight is None
    assert store.latest().step == 1
    log.close()
    dropped = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint_dropped"]
    assert len(dropped) == 1 and dropped[0]["step"] == 2 and "ActorDiedError" in dropped[0]["reason"]


def test_a_snapshot_is_read_for_its_keeper_while_a_long_step_holds_the_actors_main_thread():
    """The keeper's copy is taken at once, not after the step under way: a node lost in that
    step would otherwise take the copy with it and the restore would fall back to the store."""
    actor = Holder.remote(1 << 16, 3.0)
    [part] = checkpoint_parts.snapshot({"0": actor}, timeout_s=60).values()
    step = actor.busy.remote(20.0)
    t0 = time.monotonic()
    copy = ray.get(actor.peek_snapshot.remote(part.token), timeout=10)
    assert time.monotonic() - t0 < 10 and float(copy["w"][0]) == 3.0
    assert ray.get(actor.has_snapshot.remote(part.token), timeout=10)
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(step, timeout=30)


def test_a_keeper_keeps_the_last_two_copies_it_received_per_part():
    keeper = ReplicaKeeper.remote()
    for step in (1, 2, 3, 2):  # ... and 2 again: a run rolled back sends lower steps again
        ray.get(keeper.hold.remote("a", step, {"step": step}), timeout=30)
    assert [ray.get(keeper.has.remote("a", s), timeout=30) for s in (1, 2, 3)] == [False, True, True]
    assert ray.get(keeper.replica.remote("a", 2), timeout=30) == {"step": 2}
    with pytest.raises(ray.exceptions.RayTaskError, match=r"no replica of part 'a' at step 1 here \(held: steps \[3, 2\]\)"):
        ray.get(keeper.replica.remote("a", 1), timeout=30)


def test_a_cut_whose_copy_was_cut_off_with_its_owner_is_restored_from_the_cut_before_it(tmp_path):
    """An owner lost while its newest snapshot travelled to the keeper: that cut has a part
    with neither owner nor copy, so the cut before it is restored, every part from the
    keeper's copies, not the store."""
    ckpt, store, log = setup(tmp_path)
    actors = {"0": Holder.remote(16, 1.0), "1": Holder.remote(16, 2.0)}
    keeper = ReplicaKeeper.remote()

    def cut(step: int) -> InMemory:
        parts = checkpoint_parts.snapshot(actors, timeout_s=60)
        if step == 2:
            ray.kill(actors["1"], no_restart=True)  # lost before its copy is read
            gone(actors["1"])
        holds = {n: keeper.hold.remote(n, step, p.handle.peek_snapshot.remote(p.token)) for n, p in parts.items()}
        return InMemory(step, {"workload": {n: PartRef(n) for n in parts}, "driver": {"step": step}}, parts, dict.fromkeys(parts, keeper), holds)

    first = cut(1)
    ray.get(list(first.holds.values()), timeout=60)
    ray.get([a.add.remote(10.0) for a in actors.values()], timeout=60)
    ckpt.memory_before, ckpt.memory = first, cut(2)
    info, state, _ = ckpt.newest()
    assert info is not None and (info.step, info.path) == (1, "memory") and state["driver"]["step"] == 1
    got = ray.get([state["workload"][n] for n in ("0", "1")], timeout=60)
    assert [float(g["w"][0]) for g in got] == [1.0, 2.0]  # the values of step 1, for the survivor too
    log.close()
    [source] = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "restore_source"]
    assert source["step"] == 1 and source["parts"] == {"0": "peer", "1": "peer"}, source
    ckpt.loaded(1)  # the restore: nothing past step 1 is restored from any more
    assert ckpt.memory is None and ckpt.memory_before is first


class OneKeeper(Keepers):
    """Every part's copy goes to one given keeper (a one-node test has no other node to choose)."""

    def __init__(self, keeper):
        super().__init__(cluster=lambda: None, on_alone=lambda message: None)
        self.keeper = keeper

    def choose(self, parts):
        return dict.fromkeys(parts, self.keeper)


@ray.remote
def later(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def test_a_cut_is_sent_only_once_the_copies_of_the_one_before_reached_their_keeper(tmp_path, capfd):
    """A slow keeper (or link) never has copies queue up: while the newest cut's copies
    travel, the steps are not replicated, so the cut before the newest stays whole."""
    log = RunLog(tmp_path / "run", tensorboard=False)
    ckpt = Checkpointer(CheckpointStore(str(tmp_path / "ckpt")), CheckpointPolicy(every_steps=100), log)
    ckpt.replicate(1, cluster=lambda: None)
    keeper = ReplicaKeeper.remote()
    ckpt.keepers = OneKeeper(keeper)
    actors = {"0": Holder.remote(16, 1.0)}
    taken: list[int] = []

    def state(step: int):
        def read() -> dict:
            taken.append(step)
            return {"workload": checkpoint_parts.snapshot(actors, timeout_s=60), "driver": {"step": step}}
        return read

    ckpt.maybe(0, state(0))  # a cut of step 0; its copy lands
    ray.get(list(ckpt.memory.holds.values()), timeout=60)
    # The keeper is busy for 3 s: a hold whose input is not ready yet runs first (calls from
    # one caller run in order), so the copy of step 1 waits behind it.
    busy = keeper.hold.remote("busy", 0, later.remote(3.0))
    ckpt.maybe(1, state(1))
    for step in (2, 3):
        ckpt.maybe(step, state(step))
    assert taken == [0, 1] and (ckpt.memory.step, ckpt.memory_before.step) == (1, 0)
    assert ckpt.replicas_deferred == 2
    ray.get([busy, *ckpt.memory.holds.values()], timeout=60)
    ckpt.maybe(4, state(4))
    assert taken == [0, 1, 4] and (ckpt.memory.step, ckpt.memory_before.step) == (4, 1)
    ray.get(list(ckpt.memory.holds.values()), timeout=60)
    ckpt.maybe(5, state(5), force="test")  # the checkpoint event says how many steps went unreplicated
    log.close()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    [event] = [e for e in events if e["event"] == "checkpoint" and e["step"] == 5]
    assert event["replicas_deferred"] == 2, event
    [said] = [e for e in events if e["event"] == "replicas_deferred"]  # said once, at the first step skipped
    assert said["step"] == 2 and "every driver.replicate_every_steps=1" in said["reason"], said
    assert capfd.readouterr().err.count("replication: the copies of step 1 had not reached their keepers by step 2") == 1
