"""A whole `raylane run` on its own embedded Ray, as a user starts it from a shell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def test_a_signal_to_the_whole_process_group_leaves_a_summary_and_a_private_token(tmp_path):
    # `timeout 25 raylane run ...` (or closing the terminal) signals the whole process group,
    # which holds the embedded Ray too: the driver must not wait on the dead Ray, and the
    # run folder must say how the run ended. The fresh HOME has no token: raylane's own
    # start makes the one Ray uses, readable by its owner only.
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "raylane", "run", "linreg", "--run-name", "pg", "--no-progress",
           "--set", f"driver.runs_dir={runs}", "--set", "driver.max_steps=1000000", "--set", "driver.tensorboard=false"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(read_jsonl(runs / "pg" / "metrics.jsonl")) < 3:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
    assert took < 15, (took, out)
    summary = json.loads((runs / "pg" / "summary.json").read_text())
    assert summary["state"] == "stopped" and summary["steps"] >= 3, (summary, out)
    if summary["error"] is not None:  # Ray died before the step boundary: said, with the checkpoint to resume from
        assert "embedded Ray" in summary["error"] and "checkpoint is step" in summary["error"], summary
        assert proc.returncode != 0 and "embedded Ray" in out
    token = home / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert "can be read by other users" not in out, out
