"""Checkpoint parts without Ray: an actor's part written beside the driver's state, listed
by the manifest, read back only when every file matches it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raylane.checkpoint import CheckpointStore, part_dir
from raylane.checkpoint_format import CheckpointError, PartRef, StoredPart
from raylane.checkpoint_parts import CheckpointParts, read_part, state_bytes, write_part

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def shard(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"rows": rng.normal(size=(50, 8)).astype(np.float32), "ids": np.arange(50), "clock": seed, "w": torch.ones(3) * seed}


def save_with_parts(store: CheckpointStore, step: int, n: int = 2) -> dict[str, dict]:
    parts = {f"shards.{i}": write_part(store.uri, part_dir(store.root, step, f"shards.{i}"), shard(step * 10 + i)) for i in range(n)}
    store.save(step, {"shards": {str(i): PartRef(f"shards.{i}") for i in range(n)}, "auc": 0.5}, parts=parts)
    return parts


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_a_part_is_listed_by_the_manifest_and_read_back_whole(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save_with_parts(store, 3)
    step, state = store.load()
    assert step == 3 and state["auc"] == 0.5
    part = state["shards"]["1"]
    assert isinstance(part, StoredPart) and part.name == "shards.1" and part.step == 3
    assert same(read_part(part), shard(31))
    manifest = json.loads((tmp_path / "0000000003" / "MANIFEST.json").read_text())
    assert set(manifest["parts"]) == {"shards.0", "shards.1"} and manifest["version"] == 2
    # The driver's own state holds no shard data, only the names of the parts.
    assert (tmp_path / "0000000003" / "state.json").stat().st_size < 300
    assert store.verify(3).step == 3  # every part hashed in full


def test_parts_written_without_a_manifest_are_no_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save_with_parts(store, 1)
    write_part(store.uri, part_dir(store.root, 2, "shards.0"), shard(20))  # the driver died before the commit
    assert store.latest().step == 1
    with pytest.warns(UserWarning, match="MANIFEST.json is missing"):
        assert store.load()[0] == 1


def test_a_truncated_part_skips_the_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save_with_parts(store, 1)
    save_with_parts(store, 2)
    f = tmp_path / "0000000002" / "part-shards.1" / "tensors.pt"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.warns(UserWarning, match=r"step 2\b.*part-shards.1/tensors.pt has .* bytes.*truncated"):
        step, state = store.load()
    assert step == 1 and same(read_part(state["shards"]["1"]), shard(11))


def test_an_altered_part_is_never_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save_with_parts(store, 4)
    f = tmp_path / "0000000004" / "part-shards.0" / "tensors.pt"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF  # same size: only the hash tells
    f.write_bytes(bytes(data))
    _, state = store.load(4)
    with pytest.raises(CheckpointError, match=r"step 4, part 'shards.0'.*tensors.pt does not match the manifest"):
        read_part(state["shards"]["0"])
    with pytest.raises(CheckpointError, match="part-shards.0/tensors.pt sha256 mismatch"):
        store.verify(4)


def test_a_step_written_again_starts_from_an_empty_folder(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save_with_parts(store, 5, n=3)
    store.clear(5)
    assert not (tmp_path / "0000000005").exists() and store.steps() == []
    save_with_parts(store, 5, n=2)
    assert sorted(p.name for p in (tmp_path / "0000000005").iterdir()) == ["MANIFEST.json", "part-shards.0", "part-shards.1", "state.json"]


def test_an_adopted_checkpoint_brings_its_parts(tmp_path):
    src = CheckpointStore(str(tmp_path / "a"))
    save_with_parts(src, 7)
    dst = CheckpointStore(str(tmp_path / "b"))
    assert dst.adopt(str(tmp_path / "a" / "0000000007")) == 7
    _, state = dst.load()
    assert state["shards"]["0"].path.startswith(str(tmp_path / "b")) and same(read_part(state["shards"]["0"]), shard(70))


def test_bad_part_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"part name 'a/b'.*letters, digits"):
        part_dir(str(tmp_path), 1, "a/b")


class Holder(CheckpointParts):
    """The mixin on a plain object: snapshot, persist, load, as an actor would."""

    def __init__(self, value: float):
        self.w = np.full(4, value, np.float32)

    def export_state(self) -> dict:
        return {"w": self.w.copy()}

    def import_state(self, state) -> None:
        self.w = np.asarray(state["w"], np.float32).copy()


def test_the_actor_side_persists_the_snapshot_taken_not_the_state_now(tmp_path):
    store = CheckpointStore(str(tmp_path))
    h = Holder(1.0)
    snap = h.snapshot_part()
    assert snap["nbytes"] == 16
    h.persist_part(store.uri, part_dir(store.root, 2, "h"), snap["token"])  # a thread writes it ...
    h.w += 5  # ... while the next step runs
    files = h.part_written(snap["token"], 10.0)
    store.save(2, {"h": PartRef("h")}, parts={"h": files})
    other = Holder(0.0)
    other.load_part(store.load()[1]["h"])
    assert other.w.tolist() == [1.0] * 4
    other.load_part({"w": [2.0] * 4})  # a state given whole (a replica from memory, or a checkpoint written before parts)
    assert other.w.tolist() == [2.0] * 4


def test_an_actor_keeps_its_newest_snapshot_and_the_one_being_written_only():
    h = Holder(1.0)
    first = h.snapshot_part()["token"]
    h.w += 1
    second = h.snapshot_part()["token"]
    assert not h.has_snapshot(first) and h.has_snapshot(second)  # the older one went
    assert h.peek_snapshot(second)["w"].tolist() == [2.0] * 4
    with pytest.raises(CheckpointError, match=f"snapshot {first} is not held here"):
        h.persist_part("/nowhere", "/nowhere/x", first)
    with pytest.raises(CheckpointError, match=f"snapshot {first} is not held here"):
        h.part_written(first, 1.0)  # the waiter hears the refusal instead of waiting it out


def test_a_write_that_fails_is_the_answer_of_part_written(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    h = Holder(1.0)
    token = h.snapshot_part()["token"]
    h.persist_part(str(tmp_path), str(blocked / "part-h"), token)
    with pytest.raises(OSError):
        h.part_written(token, 10.0)


def test_state_bytes_counts_arrays_tensors_and_blobs():
    assert state_bytes({"a": np.zeros(10, np.float32), "b": [torch.zeros(2, dtype=torch.float64), b"xyz"], "c": 3}) == 40 + 16 + 3
