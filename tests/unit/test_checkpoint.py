import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from raylane.checkpoint import CheckpointError, CheckpointInfo, CheckpointStore

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

EXECUTED = []


def _mark_executed():
    EXECUTED.append(True)
    return "pwned"


class Payload:
    """Unpickling this runs _mark_executed: what a weights_only load must refuse."""

    def __reduce__(self):
        return (_mark_executed, ())


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def step_dir(root, step):
    return root / f"{step:010d}"


def rich_state():
    return {
        "model": {"w": torch.randn(3, 4), "idx": torch.arange(5), "h": torch.randn(2, 2).to(torch.bfloat16),
                  "scalar": torch.tensor(3.5)},
        "arrays": [np.linspace(0, 1, 5), np.arange(6, dtype=np.int32).reshape(2, 3),
                   np.array([True, False]), np.arange(12, dtype=np.uint16)[::3], np.full((), 2.5, dtype=np.float32)],
        "layers": [torch.ones(2), {"inner": torch.zeros(1, dtype=torch.int64)}, torch.arange(10)[2:4]],
        "blob": b"\x00\x01raw",
        "blobs": [b"", b"second"],
        "meta": {"none": None, "flag": True, "n": 7, "big": 2**70, "x": 1.5, "nan": float("nan"),
                 "inf": float("-inf"), "s": "hi \u00e9", "list": [1, "a", [2.0, None]], "empty": {}},
    }


def test_round_trip_preserves_values_and_dtypes(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    state = rich_state()
    info = store.save(7, state)
    assert isinstance(info, CheckpointInfo) and info.step == 7
    assert info.path == str(step_dir(tmp_path / "ckpt", 7))
    assert {"tensors.pt", "state.json", "blob-0.bin", "MANIFEST.json"} <= set(os.listdir(info.path))
    manifest = json.loads((step_dir(tmp_path / "ckpt", 7) / "MANIFEST.json").read_text())
    assert manifest["step"] == 7 and manifest["created"] == info.created
    assert {n: e["sha256"] for n, e in manifest["files"].items()} == info.files
    assert all(e["size"] == os.path.getsize(os.path.join(info.path, n)) for n, e in manifest["files"].items())
    step, loaded = store.load()
    assert step == 7
    assert_same(state, loaded)
    assert_same(state, CheckpointStore(str(tmp_path / "ckpt")).load(7)[1])
    assert store.verify(7) == info and store.latest() == info


@pytest.mark.parametrize("scheme", ["file", "mock"])
def test_uri_filesystems(tmp_path, scheme):
    # mock:// is pyarrow's in-memory filesystem: exercises the non-local (no rename) path.
    uri = f"file://{tmp_path}/ckpt" if scheme == "file" else "mock:///bucket/ckpt"
    store = CheckpointStore(uri, keep=1)
    store.save(1, {"t": torch.ones(2), "b": b"x"})
    store.save(2, {"t": torch.zeros(2), "b": b"y"})
    assert store.steps() == [2]
    step, state = store.load()
    assert step == 2 and torch.equal(state["t"], torch.zeros(2)) and state["b"] == b"y"


def test_keep_last_k(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in range(1, 6):
        store.save(step, {"step": step, "t": torch.full((2,), float(step))})
    assert store.steps() == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["0000000004", "0000000005"]
    assert store.load(4)[1]["step"] == 4


def test_save_never_deletes_what_it_just_wrote(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=1)
    store.save(10, {"a": 1})
    store.save(3, {"a": 2})  # e.g. a rollback that saves an older step
    assert store.steps() == [3, 10]


def _corrupt_newest(tmp_path, mutate):
    store = CheckpointStore(str(tmp_path), keep=5)
    for step in (1, 2, 3):
        store.save(step, {"t": torch.arange(1000) * step, "blob": b"payload-%d" % step * 100})
    mutate(step_dir(tmp_path, 3))
    return store


def _check_skipped(store, fname, why):
    with pytest.warns(UserWarning, match=rf"step 3\b.*{fname}.*{why}"):
        info = store.latest()
    assert info.step == 2
    with pytest.warns(UserWarning, match=fname):
        step, state = store.load()
    assert step == 2 and torch.equal(state["t"], torch.arange(1000) * 2)
    with pytest.raises(CheckpointError, match=rf"step 3\b.*{fname}.*{why}"):
        store.load(3)
    with pytest.raises(CheckpointError, match=fname):
        store.verify(3)
    assert store.steps() == [1, 2, 3]


def test_flipped_byte_is_skipped(tmp_path):
    def flip(d):
        raw = bytearray((d / "tensors.pt").read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (d / "tensors.pt").write_bytes(bytes(raw))
    _check_skipped(_corrupt_newest(tmp_path, flip), "tensors.pt", "sha256 mismatch")


@pytest.mark.parametrize("fname", ["tensors.pt", "blob-0.bin"])
def test_truncated_file_is_skipped(tmp_path, fname):
    def truncate(d):
        os.truncate(d / fname, os.path.getsize(d / fname) // 2)
    _check_skipped(_corrupt_newest(tmp_path, truncate), fname, "truncated")


def test_missing_file_and_bad_manifest_are_skipped(tmp_path):
    store = _corrupt_newest(tmp_path, lambda d: os.remove(d / "blob-0.bin"))
    _check_skipped(store, "blob-0.bin", "missing")
    (step_dir(tmp_path, 3) / "MANIFEST.json").write_text("{not json")
    _check_skipped(store, "MANIFEST.json", "unreadable")


def test_folder_without_manifest_is_ignored(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(1, {"t": torch.ones(3)})
    torn = step_dir(tmp_path, 3)
    torn.mkdir()
    (torn / "tensors.pt").write_bytes(b"PK\x03\x04 partial")
    leftover = step_dir(tmp_path, 0)
    leftover.mkdir()
    assert store.steps() == [1]
    with pytest.warns(UserWarning, match=r"step 3\b.*MANIFEST.json is missing"):  # a torn save is skipped, not silently
        assert store.latest().step == 1
    with pytest.raises(CheckpointError, match=r"existing steps: \[1\]"):
        store.load(3)
    store.save(2, {"t": torch.ones(3) * 2})
    assert not leftover.exists() and torn.exists()  # only torn folders below the saved step go
    store.save(3, {"t": torch.ones(3) * 3})
    assert store.steps() == [1, 2, 3]
    assert torch.equal(store.load()[1]["t"], torch.ones(3) * 3)


KILL_SCRIPT = """
import sys, torch
from raylane.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=3)
store.save(1, {"w": torch.arange(4.0), "note": "one"})
print("saved 1", flush=True)
big = torch.zeros(int(sys.argv[2]), dtype=torch.float32)
big.add_(torch.rand(big.numel()))
store.save(2, {"w": big, "note": "two"})
print("saved 2", flush=True)
"""


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    numel = 100_000_000  # 400 MB: torch.save + sha256 + write take a noticeable time
    for attempt in range(3):
        root = tmp_path / f"attempt{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root), str(numel)],
                                stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
        try:
            assert proc.stdout.readline().strip() == "saved 1"
            d2 = step_dir(root, 2)
            deadline = time.monotonic() + 60
            while not (d2.is_dir() and not (d2 / "MANIFEST.json").exists()):
                assert proc.poll() is None and time.monotonic() < deadline, "step 2 save never started"
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if (d2 / "MANIFEST.json").exists():
            numel = numel * 3 // 2  # race lost: the save finished before the kill landed
            continue
        assert d2.is_dir() and not (d2 / "MANIFEST.json").exists()
        store = CheckpointStore(str(root))
        assert store.steps() == [1]
        with pytest.warns(UserWarning, match=r"step 2\b.*MANIFEST.json is missing"):
            assert store.latest().step == 1
        with pytest.warns(UserWarning, match=r"step 2\b.*MANIFEST.json is missing"):
            step, state = store.load()
        assert step == 1 and state["note"] == "one" and torch.equal(state["w"], torch.arange(4.0))
        store.save(2, {"note": "retry"})  # the torn folder is replaced
        assert store.load()[1] == {"note": "retry"}
        return
    pytest.fail("SIGKILL never landed mid-save in 3 attempts; the test proved nothing")


def test_an_optimizers_state_dict_round_trips_as_it_is(tmp_path):
    """int keys (parameter ids) and tuples (Adam's betas) are kept, so a user checkpoints
    ``opt.state_dict()`` without converting it."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"opt": opt.state_dict(), "mixed": {0: "a", "b": (1, [2, (3,)])}})
    _, state = store.load()
    assert state["mixed"] == {0: "a", "b": (1, [2, (3,)])}
    want = opt.state_dict()
    assert state["opt"]["param_groups"] == want["param_groups"] and state["opt"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert set(state["opt"]["state"]) == {0, 1} and all(torch.equal(state["opt"]["state"][i]["exp_avg"], want["state"][i]["exp_avg"]) for i in (0, 1))
    again = torch.optim.Adam(model.parameters(), lr=0.01)
    again.load_state_dict(state["opt"])  # loads into a fresh optimizer


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=0)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(TypeError, match=r"state\['opt'\]\['seen'\].*set.*allowed leaves"):
        store.save(1, {"opt": {"lr": 0.1, "seen": {1, 2}}})
    with pytest.raises(TypeError, match=r"state\['cbs'\]\[1\].*object.*allowed leaves"):
        store.save(1, {"cbs": [1, object()]})
    with pytest.raises(TypeError, match=r"state\['a'\].*numeric"):
        store.save(1, {"a": np.array(["x", "y"])})
    with pytest.raises(TypeError, match=r"state\['d'\].*key 1.5 of type float.*str or int"):
        store.save(1, {"d": {1.5: "float key"}})
    with pytest.raises(CheckpointError, match=r"state\['m'\]\['__tensor__'\].*reserved"):
        store.save(1, {"m": {"__tensor__": "fake"}})
    with pytest.raises(ValueError, match="step"):
        store.save(-1, {})
    assert store.steps() == [] and os.listdir(tmp_path) == []  # nothing written on bad input
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        store.load()
    store.save(1, {})
    store.save(2, {})
    with pytest.raises(CheckpointError, match=r"step 9.*existing steps: \[1, 2\]"):
        store.load(9)
    with pytest.raises(CheckpointError, match=r"step 9.*existing steps: \[1, 2\]"):
        store.verify(9)


def test_pickle_payload_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"w": torch.ones(2)})
    d = step_dir(tmp_path, 1)
    torch.save({"w": Payload()}, d / "tensors.pt")
    raw = (d / "tensors.pt").read_bytes()
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["tensors.pt"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (d / "MANIFEST.json").write_text(json.dumps(manifest))
    assert store.verify(1).step == 1  # integrity passes: only the content is hostile
    with pytest.raises(CheckpointError, match="tensors.pt.*not a plain-tensor file"):
        store.load(1)
    with pytest.warns(UserWarning, match=r"step 1\b.*tensors.pt.*not a plain-tensor file \(it imports .*_mark_executed"):
        with pytest.raises(CheckpointError, match=r"no valid checkpoint.*\n  skipped: .*step 1\b.*not a plain-tensor file"):
            store.load()  # intact but hostile: skipped with a warning, and nothing else to load
    assert EXECUTED == []


def test_a_refused_checkpoint_is_skipped_like_a_corrupt_one(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=5)
    store.save(1, {"w": torch.ones(2)})
    store.save(2, {"w": torch.full((2,), 2.0)})
    d = step_dir(tmp_path, 2)
    torch.save({"w": Payload()}, d / "tensors.pt")
    raw = (d / "tensors.pt").read_bytes()
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["tensors.pt"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    manifest["created"] += 1  # written by someone else
    (d / "MANIFEST.json").write_text(json.dumps(manifest))
    fresh = CheckpointStore(str(tmp_path), keep=5)  # as a resumed run opens it
    for store_ in (fresh, store):
        with pytest.warns(UserWarning, match=r"step 2\b.*tensors.pt.*not a plain-tensor file") as seen:
            assert store_.latest().step == 1  # never called the last good checkpoint
        assert not any("weights_only=False" in str(w.message) for w in seen)  # torch's advice is not passed on
        with pytest.warns(UserWarning, match="not a plain-tensor file"):
            step, state = store_.load()
        assert step == 1 and torch.equal(state["w"], torch.ones(2))
    assert EXECUTED == []


def test_a_checkpoint_without_its_manifest_is_skipped_with_a_warning(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=5)
    store.save(1, {"a": 1})
    store.save(2, {"a": 2})
    (step_dir(tmp_path, 2) / "MANIFEST.json").unlink()
    with pytest.warns(UserWarning, match=r"step 2\b.*MANIFEST.json is missing"):
        assert store.latest().step == 1
    with pytest.warns(UserWarning, match=r"step 2\b.*MANIFEST.json is missing"):
        assert store.load() == (1, {"a": 1})
