"""A run whose folder fills up or refuses writes mid-run: it ends saying the true cause, with
a summary.json (in its folder, or elsewhere when the folder refuses it, and said), and no
torn checkpoint. The disk is a real one: a small tmpfs mounted for the test (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from raylane.cluster import ClusterView, NodeInfo
from raylane.driver import Driver, DriverConfig, DriverError
from raylane.placement import RoleSpec
from raylane.workload import BaseWorkload

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VIEW = ClusterView((NodeInfo("head", cpus=4, available={"CPU": 4.0}),))


class Heavy(BaseWorkload):
    """A workload without actors whose state is ``mib`` MiB; ``fill`` (a callable) runs before step ``fill_at``."""

    name = "heavy"
    main_metric = "loss"
    guarded_metrics = ()

    def __init__(self, mib: float, fill=None, fill_at: int = -1):
        self.w = np.zeros(int(mib * 2**20 / 8))
        self.fill, self.fill_at = fill, fill_at

    def roles(self):
        return [RoleSpec("thing", {"CPU": 1.0}, count=1, stateful=True)]

    def setup(self, ctx):
        pass

    def step(self, step):
        if step == self.fill_at:
            self.fill()
        self.w += 1.0
        return {"loss": 1.0 / (step + 1)}

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = state["w"]

    def done(self, step, metrics):
        return False

    def recover(self, ctx, error):
        pass

    def close(self):
        pass


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def run(disk: Path, workload, **conf) -> tuple[Driver, DriverError]:
    d = Driver(workload, DriverConfig(runs_dir=str(disk), run_name="r", progress=False, tensorboard=False, **conf),
               cluster_source=lambda: VIEW, poll_events=False)
    with pytest.raises(DriverError) as err:
        d.run()
    return d, err.value


def test_a_disk_that_fills_with_checkpoints_ends_the_run_saying_so_with_a_summary(small_disk, capfd):
    # 1 MiB a checkpoint on a 3 MiB disk: the step-0 one and one more fit, the third does not.
    d, err = run(small_disk, Heavy(1.0), max_steps=100, checkpoint_every_steps=2, keep_checkpoints=5)
    assert "No space left on device" in str(err) and "could not be written" in str(err) and "driver.checkpoint_uri" in str(err)
    assert "MANIFEST.json is missing" not in capfd.readouterr().err
    ckpts = small_disk / "r" / "checkpoints"
    folders = sorted(p.name for p in ckpts.iterdir())
    assert folders and all((ckpts / f / "MANIFEST.json").exists() for f in folders), folders  # no torn folder left
    where = small_disk / "r" / "summary.json"
    if not where.exists():  # the folder refused it too: said, and written elsewhere
        said = [ln for ln in capfd.readouterr().err.splitlines() if "summary.json could not be written" in ln]
        assert said, "the summary's place was not said"
        where = Path(said[0].rsplit(" it is at ", 1)[1])
    summary = json.loads(where.read_text())
    assert summary["state"] == "failed" and "No space left on device" in summary["error"], summary


def test_a_folder_that_refuses_every_write_leaves_the_summary_elsewhere_and_says_where(small_disk, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()

    def fill():  # something else takes the whole disk mid-run
        with open(small_disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass

    _, err = run(small_disk, Heavy(0.01, fill=fill, fill_at=3), max_steps=100, checkpoint_every_steps=1000)
    assert "No space left on device" in str(err), err
    said = [ln for ln in capfd.readouterr().err.splitlines() if "summary.json could not be written" in ln]
    assert said and "it is at " in said[0], said
    moved = Path(said[0].rsplit(" it is at ", 1)[1])
    assert moved.parent == tmp_path / "elsewhere" / "raylane-summaries"
    summary = json.loads(moved.read_text())
    assert summary["state"] == "failed" and "No space left on device" in summary["error"] and "refused it" in summary["summary_moved"]
