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
    assert took < 40, (took, out)  # not Ray's 60 s wait for a lost GCS
    summary = json.loads((runs / "pg" / "summary.json").read_text())
    assert summary["state"] == "stopped" and summary["steps"] >= 3, (summary, out)
    if summary["error"] is not None:  # Ray died before the step boundary: said, with the checkpoint to resume from
        assert "embedded Ray" in summary["error"] and "checkpoint is step" in summary["error"], summary
        assert proc.returncode != 0 and "embedded Ray" in out
    token = home / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert "can be read by other users" not in out, out


def test_a_reused_run_name_resumes_only_its_own_config(ray_local, tmp_path, capfd):
    from raylane import config as cfg
    from raylane.launch import run_job
    from raylane.prepare import job_config as load_job_config
    from raylane.registry import get

    spec = get("linreg")
    base = [f"driver.runs_dir={tmp_path}", "driver.max_steps=6", "driver.progress=false", "driver.tensorboard=false"]
    first = run_job(spec, load_job_config(spec, overrides=base, run_name="lin"))
    assert first["state"] == "finished" and first["steps"] == 6
    with pytest.raises(cfg.ConfigError, match=r"lr: 0.5 \(run\) -> 0.1 \(now\)"):
        run_job(spec, load_job_config(spec, overrides=[*base, "lr=0.1"], run_name="lin"))
    assert json.loads((tmp_path / "lin" / "summary.json").read_text()) == first  # nothing ran, nothing overwritten
    more = run_job(spec, load_job_config(spec, overrides=[*base[:1], "driver.max_steps=9", *base[2:]], run_name="lin"), resume_with_changes=True)
    assert more["resumed_from"] == 6 and more["steps"] == 9
    err = capfd.readouterr().err
    assert "resuming with a changed driver.max_steps: 6 -> 9" in err and "resuming run 'lin' from step 6" in err
    changed = [e for e in read_jsonl(tmp_path / "lin" / "events.jsonl") if e["event"] == "config_changed"]
    assert changed[0]["changes"] == [{"key": "driver.max_steps", "run": 6, "now": 9}]
    fresh = run_job(spec, load_job_config(spec, overrides=[*base, "lr=0.1"], run_name="lin"), new=True)
    assert fresh["run"] == "lin-2" and fresh["resumed_from"] is None and fresh["steps"] == 6
    renamed = [e for e in read_jsonl(tmp_path / "lin-2" / "events.jsonl") if e["event"] == "run_renamed"]
    assert renamed and renamed[0]["asked"] == "lin" and renamed[0]["used"] == "lin-2"
    assert "--new starts a fresh run named 'lin-2'" in capfd.readouterr().err


def test_a_finished_run_asked_again_says_so_and_leaves_its_files_untouched(ray_local, tmp_path, capfd):
    from raylane.launch import run_job
    from raylane.prepare import job_config as load_job_config
    from raylane.registry import get

    spec = get("linreg")
    base = [f"driver.runs_dir={tmp_path}", "driver.max_steps=5", "driver.progress=false", "driver.tensorboard=false"]
    first = run_job(spec, load_job_config(spec, overrides=base, run_name="done"))
    assert first["state"] == "finished" and first["final_metrics"] and first["checkpoints_written"] > 0
    folder = tmp_path / "done"
    before = {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}
    again = run_job(spec, load_job_config(spec, overrides=base, run_name="done"))
    assert again == first
    assert "run 'done' finished at step 5; its files are left as they are" in capfd.readouterr().err
    after = {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    # Asked to go on with a change that does not extend it (a new lr, the same max_steps): it
    # resumes where it ended and its summary keeps the values it had there.
    same = run_job(spec, load_job_config(spec, overrides=[*base, "lr=0.4"], run_name="done"), resume_with_changes=True)
    assert same["steps"] == 5 and same["resumed_from"] == 5
    assert same["final_metrics"]["loss"] == first["final_metrics"]["loss"], (same, first)


def test_a_second_run_under_a_busy_name_is_refused_naming_the_holder(ray_local, tmp_path):
    from raylane import config as cfg
    from raylane.launch import run_job
    from raylane.prepare import job_config as load_job_config
    from raylane.registry import get
    from raylane.runlock import RunLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from raylane.runlock import RunLock; "
                               "l = RunLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(60)", str(tmp_path / "busy")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        spec = get("linreg")
        conf = load_job_config(spec, overrides=[f"driver.runs_dir={tmp_path}", "driver.max_steps=3", "driver.progress=false"], run_name="busy")
        with pytest.raises(cfg.ConfigError, match=rf"in use by process {holder.pid} on host"):
            run_job(spec, conf)
        assert not (tmp_path / "busy" / "config.json").exists() and not (tmp_path / "busy" / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # Killed while holding it: the next run takes the folder over and says so.
    summary = run_job(spec, conf)
    assert summary["state"] == "finished"
    taken = [e for e in read_jsonl(tmp_path / "busy" / "events.jsonl") if e["event"] == "run_lock_taken_over"]
    assert taken and f"process {holder.pid}" in taken[0]["reason"]
    with RunLock(tmp_path / "busy") as lock:  # released cleanly at the run's end: nothing to take over now
        assert lock.took_over is None


def test_more_workers_than_the_cluster_holds_is_said_and_logged_with_what_is_missing(ray_local, tmp_path, capfd):
    from raylane.launch import run_job
    from raylane.prepare import job_config as load_job_config
    from raylane.registry import get

    spec = get("linreg")
    over = [f"driver.runs_dir={tmp_path}", "driver.max_steps=3", "driver.progress=false", "driver.tensorboard=false",
            "workers=20", "max_workers=24"]
    summary = run_job(spec, load_job_config(spec, overrides=over, run_name="many"))
    assert summary["state"] == "finished"
    short = [e for e in read_jsonl(tmp_path / "many" / "events.jsonl") if e["event"] == "shortfall"]
    assert len(short) == 1 and short[0]["role"] == "grad_worker" and short[0]["asked"] == 20, short
    got = short[0]["got"]
    assert 1 <= got < 20 and short[0]["missing"] == {"CPU": float(20 - got)}
    err = capfd.readouterr().err
    assert f"grad_worker: asked for 20, the cluster holds {got} now; missing CPU={20 - got}" in err, err


STALE = """
import ray
from raylane import session
from raylane.launch import run_job
from raylane.prepare import job_config as load_job_config
from raylane.registry import get

session.connect(None, num_cpus=2)       # raylane starts a Ray of its own ...
ray.shutdown()                          # ... the user shuts it down the plain way
ray.init(address="local", num_cpus=2)   # and starts another (a notebook, a test suite)
spec = get("linreg")
conf = load_job_config(spec, overrides=["driver.runs_dir={runs}", "driver.max_steps=3", "driver.progress=false", "driver.tensorboard=false"])
print(run_job(spec, conf)["state"])
"""


def test_a_run_on_a_ray_started_after_raylanes_own_was_shut_down_is_not_taken_for_a_dead_ray(tmp_path):
    # The watchdog of raylane's embedded Ray ends the process when that Ray dies under the
    # driver; a record of an earlier, cleanly stopped start must not make it end this one.
    done = subprocess.run([sys.executable, "-c", STALE.format(runs=tmp_path)], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0 and done.stdout.strip().endswith("finished"), (done.stdout[-2000:], done.stderr[-3000:])
