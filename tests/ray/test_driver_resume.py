"""A driver process killed with SIGKILL mid-run resumes at its last checkpoint.

Each run is a real `python -m raylane run linreg` process with its own embedded Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from raylane.checkpoint import CheckpointStore

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ARGS = ["--set", "rows=400000", "--set", "driver.max_steps=120", "--set", "driver.checkpoint_every_steps=5", "--set", "lr=0.05", "--no-progress"]


def launch(tmp_path: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "raylane", "run", "linreg", "--run-name", name, "--set", f"driver.runs_dir={tmp_path}", *ARGS]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 200) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [l for l in path.read_text().splitlines() if l.strip()]
    return len(lines)


def test_sigkilled_driver_resumes_at_last_checkpoint_and_matches_uninterrupted_run(tmp_path):
    reference = launch(tmp_path, "reference")
    finish(reference)

    victim = launch(tmp_path, "victim")
    run_dir = tmp_path / "victim"
    deadline = time.time() + 150
    while time.time() < deadline and steps_logged(run_dir) < 17:
        assert victim.poll() is None, victim.stdout.read()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the driver and anything it started in its session
    victim.wait(timeout=30)
    killed_at = steps_logged(run_dir)
    assert 17 <= killed_at < 120, f"the kill must land mid-run, landed at step {killed_at}"
    last = CheckpointStore(str(run_dir / "checkpoints")).latest()
    assert last is not None and last.step % 5 == 0 and last.step <= killed_at

    out = finish(launch(tmp_path, "victim"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == last.step, out
    assert summary["state"] == "finished" and summary["steps"] == 120
    resume_events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if '"resume"' in l]
    assert [e["step"] for e in resume_events] == [last.step]

    _, ref_state = CheckpointStore(str(tmp_path / "reference" / "checkpoints")).load_whole()
    _, got_state = CheckpointStore(str(run_dir / "checkpoints")).load_whole()
    # Gradients are summed in shard order, so the resumed run ends bit-for-bit equal.
    assert np.array_equal(ref_state["workload"]["w"], got_state["workload"]["w"])
    assert json.loads((tmp_path / "reference" / "summary.json").read_text())["final_metrics"]["loss"] == summary["final_metrics"]["loss"]


@pytest.mark.slow  # long (30-45 s); the default run keeps this job's other fault tests
def test_sigkilled_ppo_driver_resumes_at_the_last_checkpointed_iteration(tmp_path):
    args = ["--set", "total_env_steps=40000", "--set", "target_return=null", "--set", "driver.checkpoint_every_steps=5", "--set", "plot=false"]
    cmd = [sys.executable, "-m", "raylane", "run", "ppo", "--run-name", "ppo", "--set", f"driver.runs_dir={tmp_path}", "--no-progress", *args]
    victim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run_dir = tmp_path / "ppo"
    deadline = time.time() + 150
    while time.time() < deadline and steps_logged(run_dir) < 12:
        assert victim.poll() is None, victim.stdout.read()
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    killed_at = steps_logged(run_dir)
    last = CheckpointStore(str(run_dir / "checkpoints")).latest()
    assert last is not None and 10 <= last.step <= killed_at
    _, saved = CheckpointStore(str(run_dir / "checkpoints")).load_whole(last.step)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == last.step
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    after = [r for r in rows if r["step"] == last.step + 1]
    # the first iteration after the restart continues the env-step count of the checkpoint
    assert after[-1]["env_steps"] == saved["workload"]["env_steps"] + 2 * 8 * 32
    assert summary["final_metrics"]["env_steps"] >= 40000


PS_ARGS = ["--set", "rows=20000", "--set", "eval_rows=4000", "--set", "buckets=100000", "--set", "embedding_dim=32", "--set", "mode=sync",
           "--set", "driver.max_steps=14", "--set", "driver.checkpoint_every_steps=1", "--no-progress"]


@pytest.mark.slow  # five driver processes, about a minute and a half
def test_sigkilled_ps_driver_during_persists_resumes_from_a_whole_checkpoint_and_ends_exact(tmp_path):
    """Every step's checkpoint is persisted by the shards while the next step runs, so a
    driver killed mid-run always leaves a checkpoint in flight. Killed three times at
    different steps, the run resumes each time from the newest whole checkpoint (never the
    torn one after it) and ends with the loss and AUC of the run that was never killed."""
    def cmd(name: str) -> list[str]:
        return [sys.executable, "-m", "raylane", "run", "ps_ctr", "--run-name", name, "--set", f"driver.runs_dir={tmp_path}", *PS_ARGS]

    out = subprocess.run(cmd("calm"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    calm = json.loads((tmp_path / "calm" / "summary.json").read_text())
    run_dir = tmp_path / "victim"
    for kill_after in (3, 7, 11):
        victim = subprocess.Popen(cmd("victim"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.time() + 150
        while time.time() < deadline and steps_logged(run_dir) < kill_after:
            assert victim.poll() is None, victim.stdout.read()
            time.sleep(0.02)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        store = CheckpointStore(str(run_dir / "checkpoints"))
        last = store.latest()
        assert last is not None and last.step <= steps_logged(run_dir), (last, steps_logged(run_dir))
        store.load_whole(last.step)  # every part of the newest whole checkpoint reads back against its manifest
        newer = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit() and int(p.name) > last.step]
        assert all(not (p / "MANIFEST.json").exists() for p in newer), newer  # what was in flight never became a checkpoint
    out = subprocess.run(cmd("victim"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps"] == 14
    exact = ("loss", "auc")
    assert {k: summary["final_metrics"][k] for k in exact} == {k: calm["final_metrics"][k] for k in exact}
