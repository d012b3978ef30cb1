"""``raylane tune`` on one local Ray: a random search of linreg, an ASHA search of ppo,
PBT on linreg exploiting a donor's checkpoint, and a trial whose driver process is
SIGKILLed, restarted by Tune from its newest raylane checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from raylane.runlog import read_jsonl
from raylane.tune.run import Search, tune
from raylane.tune.space import parse_search

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

SMALL_LINREG = ["workers=1", "rows=4096", "driver.tensorboard=false", "driver.control=false"]


def _events(row, kind):
    return [e for e in read_jsonl(os.path.join(row["run_dir"], "events.jsonl")) if e["event"] == kind]


def test_random_search_of_linreg_reports_every_trial_and_the_best_command(ray_tune, tmp_path):
    s = Search(job="linreg", space=parse_search(["lr=loguniform(0.02,0.5)", "noise=choice([0.05, 0.1])"]),
               overrides=SMALL_LINREG + ["driver.max_steps=6"], trials=4, concurrency=2, runs_dir=str(tmp_path), name="rand", seed=3)
    prep, rows, files = tune(s, say=lambda m: None)
    assert (prep.metric, prep.mode) == ("loss", "min")
    assert len(rows) == 4 and all(r["state"] == "finished" and r["steps"] == 6 for r in rows)
    assert all(0.02 <= r["config/lr"] <= 0.5 and r["config/noise"] in (0.05, 0.1) for r in rows)
    assert len({r["config/lr"] for r in rows}) == 4  # sampled, not one value four times
    bests = [r["best_loss"] for r in rows]
    assert bests == sorted(bests)  # best first
    for r in rows:  # each trial is its own raylane run, with the values it was given
        metrics = read_jsonl(os.path.join(r["run_dir"], "metrics.jsonl"))
        assert [m["step"] for m in metrics] == list(range(1, 7))
        assert min(m["loss"] for m in metrics) == pytest.approx(r["best_loss"])
        assert _events(r, "tune_trial")[0]["values"] == {"lr": r["config/lr"], "noise": r["config/noise"]}
    assert files["csv"].read_text().count("\n") == 5
    assert files["png"].stat().st_size > 5_000
    from raylane.tune.results import command_line

    line = command_line("linreg", s.overrides, None, rows[0])
    assert f"lr={rows[0]['config/lr']!r}" in line and line.startswith("raylane run linreg --set workers=1")


def test_asha_stops_the_worse_trials_at_a_step_boundary(ray_tune, tmp_path):
    # best first: the later, worse trials meet the better ones' records at ASHA's first rung
    s = Search(job="linreg", space=parse_search(["lr=grid([0.45, 0.3, 0.05, 0.02])"]), overrides=SMALL_LINREG + ["driver.max_steps=8"],
               trials=1, concurrency=2, scheduler="asha", grace_steps=1, runs_dir=str(tmp_path), name="asha", seed=0)
    prep, rows, files = tune(s, say=lambda m: None)
    assert len(rows) == 4 and [r["config/lr"] for r in rows] == [0.45, 0.3, 0.05, 0.02]
    assert rows[0]["state"] == "finished" and rows[0]["steps"] == 8
    stopped = [r for r in rows if r["state"] == "stopped"]
    assert stopped and all(r["steps"] < 8 for r in stopped), rows
    for r in stopped:  # stopped as a stop request stops a run: at a step boundary, with a checkpoint and a summary
        assert _events(r, "checkpoint")[-1]["step"] == r["steps"]
        assert "Ray Tune" in _events(r, "state")[-1]["reason"]


def test_asha_search_of_ppo_finishes_with_the_best_trial_and_its_command(ray_tune, tmp_path):
    s = Search(job="ppo", space=parse_search(["lr=loguniform(1e-4,3e-3)"]),
               overrides=["workers=1", "envs_per_worker=4", "rollout_steps=32", "epochs=2", "target_return=null", "driver.max_steps=6",
                          "driver.tensorboard=false", "driver.control=false", "worker_cpus=0.5"],
               trials=4, concurrency=2, scheduler="asha", grace_steps=1, runs_dir=str(tmp_path), name="asha", seed=0)
    prep, rows, files = tune(s, say=lambda m: None)
    assert (prep.metric, prep.mode) == ("return_mean", "max")
    assert len(rows) == 4 and all(r["state"] in ("finished", "stopped") for r in rows), rows
    assert all(1 <= r["steps"] <= 6 for r in rows) and any(r["steps"] == 6 for r in rows)
    assert rows[0]["best_return_mean"] == max(r["best_return_mean"] for r in rows)
    for r in rows:  # every trial placed its learner and its worker as a single run does
        plan = _events(r, "plan")[0]["assignments"]
        assert {a["role"] for a in plan} == {"learner", "rollout_worker"}
        assert [a["market"] for a in plan if a["role"] == "learner"] == ["on-demand"]
    from raylane.tune.results import command_line

    line = command_line("ppo", s.overrides, None, rows[0])
    assert line.startswith("raylane run ppo --set workers=1") and f"lr={rows[0]['config/lr']!r}" in line


def test_pbt_exploit_continues_from_the_donors_checkpoint(ray_tune, tmp_path):
    # Synchronous PBT: at step 2 all four trials are compared, so the worst one exploits. (Without
    # it Tune compares only the trials still running; these trials take about a second each and
    # start up to two apart, so the worst may start after the others have finished.)
    s = Search(job="linreg", space=parse_search(["lr=uniform(0.01,0.45)"]), overrides=SMALL_LINREG + ["driver.max_steps=4"],
               trials=4, concurrency=4, scheduler="pbt", perturbation_interval=2, pbt_synch=True, runs_dir=str(tmp_path), name="pbt", seed=1)
    prep, rows, files = tune(s, say=lambda m: None)
    assert any("checkpoint every 2 steps" in n for n in prep.notes)
    search = [e for e in read_jsonl(os.path.join(str(tmp_path), "pbt", "events.jsonl")) if e["event"] == "tune_search"][-1]
    assert search["pbt_synch"] is True and search["perturbation_interval"] == 2
    assert any(n.startswith("pbt: synchronous") for n in search["decided"])
    exploited = [r for r in rows if r["exploits"]]
    assert exploited, rows
    by_trial = {r["trial"]: r for r in rows}
    for r in exploited:
        starts = sorted((e for e in read_jsonl(os.path.join(r["run_dir"], "events.jsonl"))
                         if e["event"] in ("tune_exploit", "tune_restore")), key=lambda e: e["time"])
        mine = _all_rows(r)
        for ev, nxt in zip(starts, starts[1:] + [None]):
            if ev["event"] != "tune_exploit":
                continue
            donor, at = ev["donor"], ev["step"]
            assert donor != r["trial"] and donor in by_trial and at >= 2
            # The first step after the exploit continues from the donor's weights of step `at`.
            # A later exploit may go back to a lower step (its donor was behind): the rows this
            # one wrote then moved to metrics.discarded.jsonl, so both files are read.
            end = nxt["time"] if nxt else float("inf")
            after = [m for m in mine if ev["time"] < m["time"] < end]
            assert after and after[0]["step"] == at + 1, (ev, after[:3])
            donor_rows = _all_rows(by_trial[donor])
            donor_at = [m for m in donor_rows if m["step"] == at and m["time"] < ev["time"]]
            assert donor_at and after[0]["loss"] <= donor_at[-1]["loss"] * 1.01
            # linreg reports the loss of the weights a step starts from: the exploited trial's
            # first step starts from the donor's weights of step `at`, as the donor's own next
            # step did, so the two losses are the same number (whatever lr each then applied).
            donor_next = [m["loss"] for m in donor_rows if m["step"] == at + 1 and m["time"] > donor_at[-1]["time"]]
            assert donor_next and after[0]["loss"] == donor_next[0], (after[0], donor_next)
            donor_at = [m["loss"] for m in donor_at]
            own_at = [m["loss"] for m in mine if m["step"] == at and m["time"] < ev["time"]]
            if own_at and own_at[-1] > donor_at[-1] * 1.05:  # the trial's own weights were worse: it left them
                assert after[0]["loss"] < own_at[-1]
        assert _events(r, "config_changed") or _events(r, "tune_trial")[-1]["values"] != _events(r, "tune_trial")[0]["values"]


def _all_rows(row):
    """Every step the trial's run wrote, kept or rewound, in time order."""
    rows = [m for name in ("metrics.jsonl", "metrics.discarded.jsonl") for m in read_jsonl(os.path.join(row["run_dir"], name))]
    return sorted(rows, key=lambda m: m["time"])


def test_a_trial_whose_driver_is_sigkilled_is_restarted_from_its_newest_checkpoint(ray_tune, tmp_path):
    s = Search(job="linreg", space=parse_search(["lr=choice([0.3])"]),
               overrides=SMALL_LINREG + ["driver.max_steps=30", "driver.checkpoint_every_steps=5", "step_timeout_s=30"],
               trials=1, concurrency=1, runs_dir=str(tmp_path), name="kill", max_failures=2)
    killed = {}

    def kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            for d in (tmp_path / "kill" / "trials").glob("*") if (tmp_path / "kill" / "trials").exists() else []:
                ev = [e for e in read_jsonl(d / "events.jsonl") if e["event"] in ("tune_trial", "checkpoint")]
                starts = [e for e in ev if e["event"] == "tune_trial"]
                if starts and any(e["event"] == "checkpoint" and e["step"] >= 10 for e in ev):
                    killed.update(pid=starts[-1]["pid"], step=max(e["step"] for e in ev if e["event"] == "checkpoint"))
                    os.kill(starts[-1]["pid"], signal.SIGKILL)
                    return
            time.sleep(0.05)

    # slow the steps down a little so the kill lands mid-run: more rows
    s.overrides.append("rows=60000")
    s.overrides.remove("rows=4096")
    t = threading.Thread(target=kill, daemon=True)
    t.start()
    prep, rows, files = tune(s, say=lambda m: None)
    t.join(5)
    assert killed, "the trial's driver was never seen with a checkpoint"
    (row,) = rows
    assert row["state"] == "finished" and row["steps"] == 30
    assert row["restarts"] == 1 and row["resumed_from"][0] >= killed["step"] >= 10  # not from scratch
    starts = _events(row, "tune_trial")
    assert len(starts) == 2 and starts[0]["pid"] == killed["pid"] != starts[1]["pid"]
    steps = [m["step"] for m in read_jsonl(os.path.join(row["run_dir"], "metrics.jsonl"))]
    assert steps == list(range(1, 31))  # one row per step: the replayed ones replaced


USER_JOB = '''
from dataclasses import dataclass, field
from raylane.api import BaseWorkload, DriverConfig, JobSpec


@dataclass
class Config:
    """A job with no actors: a loss that falls by lr a step."""

    lr: float = 0.1
    """Step size."""
    fail: bool = False
    """Raise in the first step (a bug, not a fault: the trial fails)."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=3, tensorboard=False, control=False))
    """Run name, stop rules, checkpoints."""


class Workload(BaseWorkload):
    name = "falls"
    main_metric = "loss"

    def __init__(self, config):
        self.config, self.loss = config, 1.0

    def roles(self):
        return []

    def setup(self, ctx):
        pass

    def step(self, step):
        if self.config.fail:
            raise ValueError("this job always fails")
        self.loss -= self.config.lr
        return {"loss": self.loss}

    def state_dict(self):
        return {"loss": self.loss}

    def load_state_dict(self, state):
        self.loss = state["loss"]


JOB = JobSpec("falls", "A loss that falls.", Config, Workload)
'''


@pytest.mark.parametrize("fail", [False, True])
def test_a_users_job_file_named_relative_to_the_working_folder_and_a_search_whose_trials_all_fail(tmp_path, fail):
    """Trials run in Tune's own folders: a job file named relative to where the user stands
    still loads in every trial. When every trial fails, the search ends with their errors
    and exit code 1, never with an errored trial named best. (The command as a user runs it,
    on its own embedded Ray.)"""
    import subprocess
    import sys

    (tmp_path / "jobs_dir").mkdir()
    (tmp_path / "jobs_dir" / "my_job.py").write_text(USER_JOB)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "raylane", "tune", "jobs_dir/my_job.py:JOB", "--search", "lr=choice([0.1, 0.2])", "--trials", "2",
           "--concurrency", "2", "--trial-cpus", "0.5", "--max-failures", "0", "--set", f"fail={str(fail).lower()}",
           "--runs-dir", str(tmp_path / "runs"), "--name", "user"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    if not fail:
        assert done.returncode == 0, out
        assert "best trial" in out and "FileNotFoundError" not in out, out
    else:
        assert done.returncode == 1, out
        assert "all 2 trials failed; no best trial" in out and "best trial " not in out, out
        assert out.count("this job always fails") >= 2, out
