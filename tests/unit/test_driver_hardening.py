"""The driver's stops, resumes and refused checkpoints against an in-process workload: no Ray."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal

import pytest
import torch

from raylane.checkpoint import CheckpointStore
from raylane.driver import DriverError, RunAborted, State
from raylane.runlog import read_jsonl
from test_driver_fake import Counter, drive, reference  # tests/unit/test_driver_fake.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Hostile:
    """Unpickling this would call print: what a weights-only load refuses."""

    def __reduce__(self):
        return (print, ("this must never run",))


def poison(store_dir, step: int) -> None:
    """Replace a checkpoint's tensor file by a pickle, with a manifest that matches it."""
    d = store_dir / f"{step:010d}"
    torch.save({"x": Hostile()}, d / "tensors.pt")
    raw = (d / "tensors.pt").read_bytes()
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["tensors.pt"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (d / "MANIFEST.json").write_text(json.dumps(manifest))


def test_ctrl_c_stops_at_the_next_step_with_a_checkpoint(tmp_path, capfd):
    class Interrupted(Counter):
        def step(self, step):
            if step == 6:
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
            return super().step(step)

    before = signal.getsignal(signal.SIGINT)
    w = Interrupted()
    d, summary = drive(tmp_path, w, max_steps=20, checkpoint_every_steps=0)
    assert d.state is State.STOPPED and summary["state"] == "stopped" and summary["error"] is None
    assert summary["stop_reason"].startswith("SIGINT")
    assert summary["steps"] == 7 and w.applied == list(range(7))  # the interrupted step completed
    assert CheckpointStore(str(tmp_path / "r" / "checkpoints")).latest().step == 7
    assert signal.getsignal(signal.SIGINT) == before
    assert "Ctrl-C again aborts" in capfd.readouterr().err


def test_a_second_ctrl_c_aborts_at_once_and_says_so(tmp_path):
    class Twice(Counter):
        def step(self, step):
            if step == 3:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return super().step(step)

    w = Twice()
    with pytest.raises(RunAborted, match=r"aborted at step 3 \(Ctrl-C twice\).*last good checkpoint is step 0"):
        drive(tmp_path, w, max_steps=20, checkpoint_every_steps=0)
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["state"] == "stopped" and w.applied == [0, 1, 2]


def test_a_refused_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(tmp_path, capfd):
    drive(tmp_path, Counter(), max_steps=8, checkpoint_every_steps=4)
    store_dir = tmp_path / "r" / "checkpoints"
    poison(store_dir, 8)
    w = Counter()
    with pytest.warns(UserWarning, match=r"step 8\b.*tensors.pt.*not a plain-tensor file"):
        d, summary = drive(tmp_path, w, max_steps=10, checkpoint_every_steps=4)
    assert summary["state"] == "finished" and summary["resumed_from"] == 4
    assert w.applied == list(range(4, 10)) and math.isclose(w.x, reference(10))
    events = read_jsonl(tmp_path / "r" / "events.jsonl")
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and "step 8" in skipped[0]["reason"] and "weights_only=False" not in skipped[0]["reason"]
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    assert "resuming run 'r' from step 4" in capfd.readouterr().err


def test_a_run_that_cannot_start_keeps_the_summary_of_the_finished_run(tmp_path):
    drive(tmp_path, Counter(), max_steps=5)
    finished = json.loads((tmp_path / "r" / "summary.json").read_text())

    class Mismatch(Counter):
        def load_state_dict(self, state):
            raise ValueError("size mismatch for weight: copying a param with shape [4] into shape [8]")

    with pytest.raises(DriverError, match="size mismatch"):
        drive(tmp_path, Mismatch(), max_steps=9)
    assert json.loads((tmp_path / "r" / "summary.json").read_text()) == finished
    start_failed = [e for e in read_jsonl(tmp_path / "r" / "events.jsonl") if e["event"] == "start_failed"]
    assert len(start_failed) == 1 and "size mismatch" in start_failed[0]["error"]


def test_a_run_with_no_checkpoint_that_loads_starts_over_and_says_so(tmp_path, capfd):
    drive(tmp_path, Counter(), max_steps=4, checkpoint_every_steps=0, keep_checkpoints=1)
    store_dir = tmp_path / "r" / "checkpoints"
    assert CheckpointStore(str(store_dir)).steps() == [4]
    poison(store_dir, 4)
    w = Counter()
    with pytest.warns(UserWarning, match="not a plain-tensor file"):
        d, summary = drive(tmp_path, w, max_steps=4, checkpoint_every_steps=0, keep_checkpoints=1)
    assert summary["resumed_from"] is None and w.applied == [0, 1, 2, 3]
    none = [e for e in read_jsonl(tmp_path / "r" / "events.jsonl") if e["event"] == "resume_none"]
    assert len(none) == 1 and none[0]["skipped"] == 1
    assert "has no checkpoint that loads (1 skipped" in capfd.readouterr().err


def test_a_recovery_that_keeps_failing_ends_at_max_recovery_s_not_at_the_failure_count(tmp_path):
    import time

    class NeverBack(Counter):
        def recover(self, ctx, error):
            self.recoveries += 1
            time.sleep(0.2)  # each attempt takes at least this long, so the bound must bite
            raise PoolError(f"still no room (attempt {self.recoveries})")

    from raylane.group import PoolError

    w = NeverBack(fail_at={3})
    with pytest.raises(DriverError, match=r"recovery did not succeed within max_recovery_s=1 s") as info:
        drive(tmp_path, w, max_steps=10, max_failures=1000, max_recovery_s=1.0)
    assert 3 <= w.recoveries <= 20 and "still no room" in str(info.value)
    failures = [e for e in read_jsonl(tmp_path / "r" / "events.jsonl") if e["event"] == "failure"]
    assert failures[-1]["decision"] == "fail" and all(e["decision"] == "recover" for e in failures[:-1])


def test_replayed_steps_leave_one_row_per_step_in_metrics_and_the_first_values_are_kept_aside(tmp_path):
    w = Counter(fail_at={7})
    d, summary = drive(tmp_path, w, max_steps=10, checkpoint_every_steps=5, tensorboard=True)
    assert w.applied == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]  # steps 6 and 7 ran twice
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[-1]["x"] == pytest.approx(reference(10))
    aside = read_jsonl(tmp_path / "r" / "metrics.discarded.jsonl")
    assert [r["step"] for r in aside] == [6, 7] and all("checkpoint of step 5" in r["discarded"] for r in aside)
    rewound = [e for e in read_jsonl(tmp_path / "r" / "events.jsonl") if e["event"] == "metrics_rewound"]
    assert [(e["step"], e["discarded"]) for e in rewound] == [(5, 2)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "r" / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("x")] == list(range(1, 11))  # the purged first copies are hidden


def test_a_resumed_run_drops_the_rows_its_killed_predecessor_wrote_past_the_checkpoint(tmp_path):
    d, first = drive(tmp_path, Counter(), max_steps=8, checkpoint_every_steps=5, keep_checkpoints=3)
    store = tmp_path / "r" / "checkpoints"
    import shutil

    shutil.rmtree(store / f"{8:010d}")  # as if killed after step 8's row, before its checkpoint
    d, again = drive(tmp_path, Counter(), max_steps=10, checkpoint_every_steps=5)
    assert again["resumed_from"] == 5
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == list(range(1, 11))
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.discarded.jsonl")] == [6, 7, 8]


def test_the_driver_measures_steps_wall_time_and_the_workloads_own_progress(tmp_path):
    class Budgeted(Counter):
        def progress_of(self, step, metrics):
            return step * 100, 10_000, "samples"

    from raylane.run_state import State, Stepped
    from raylane.watchers import ProgressBar

    d, _ = drive(tmp_path, Budgeted(), max_steps=4, max_wall_s=3600)
    units = {unit: (done, total) for done, total, unit in ProgressBar.measures(d, Stepped(State.FINISHED, 4, {"loss": 0.1}))}
    assert units["steps"] == (4.0, 4.0) and units["samples"] == (400.0, 10_000.0)
    assert units["s"][1] == 3600 and units["s"][0] >= 0


def test_every_run_leaves_a_plot_of_its_main_metric_beside_the_summary(tmp_path):
    d, summary = drive(tmp_path, Counter(), max_steps=5)
    png = tmp_path / "r" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "r" / "summary.json").exists()


def test_a_run_that_starts_over_without_checkpoints_drops_the_rows_of_its_earlier_start(tmp_path):
    import shutil

    drive(tmp_path, Counter(), max_steps=4, checkpoint_every_steps=2)
    shutil.rmtree(tmp_path / "r" / "checkpoints")  # every checkpoint gone: the run starts over at step 0
    d, again = drive(tmp_path, Counter(), max_steps=3, checkpoint_every_steps=2)
    assert again["resumed_from"] is None
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.discarded.jsonl")] == [1, 2, 3, 4]
