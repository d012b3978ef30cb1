"""``raylane tune`` on the simulated spot cluster: the trials' drivers on the on-demand
head (their placement group refuses spot nodes), their workers on spot nodes; a spot node
removed mid-search, without notice or after one (which every trial's driver hears). Every trial completes all its steps, and none restarts:
the lost workers are replaced inside each trial by its own pool."""

from __future__ import annotations

import os
import threading
import time

import pytest

from raylane.runlog import read_jsonl
from raylane.tune.run import Search, tune
from raylane.tune.space import parse_search

from market_helpers import wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

STEPS = 90  # long enough that the trials still run when a 6 s notice ends


@pytest.mark.parametrize("notice_s", [0.0, 6.0], ids=["no-notice", "notice"])
def test_a_spot_node_lost_mid_search_costs_no_trial_and_no_restart(spot_cluster, tmp_path, notice_s):
    wait_all_free()
    s = Search(job="linreg", space=parse_search(["lr=uniform(0.2,0.45)"]),
               overrides=["workers=2", "max_workers=2", "rows=400000", "features=32", f"driver.max_steps={STEPS}",
                          "driver.checkpoint_every_steps=5", "step_timeout_s=30", "driver.tensorboard=false", "driver.control=false"],
               trials=2, concurrency=2, runs_dir=str(tmp_path), name="spot", seed=0)
    removed = {}

    def chaos():
        trials = tmp_path / "spot" / "trials"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            runs = list(trials.glob("*")) if trials.exists() else []
            steps = [len(read_jsonl(d / "metrics.jsonl")) for d in runs]
            if len(runs) == 2 and min(steps) >= 8:
                plans = [e for d in runs for e in read_jsonl(d / "events.jsonl") if e["event"] == "plan"]
                used = {a["node_id"] for p in plans for a in p["assignments"] if a["role"] == "grad_worker"}
                victim = next(n for n in spot_cluster.nodes.values() if n.node_id in used)
                removed.update(name=victim.name, at=min(steps), node=victim.node_id)
                if notice_s:  # drained with a deadline first: every trial's driver hears of it at a step boundary, as a single run does (a trial's boundaries can be seconds apart while Tune saves its state, so the notice is 6 s)
                    spot_cluster.preempt(victim, notice_s=notice_s)
                else:
                    spot_cluster.remove(victim)
                return
            time.sleep(0.05)

    t = threading.Thread(target=chaos, daemon=True)
    t.start()
    prep, rows, files = tune(s, say=lambda m: None)
    t.join(30)
    assert removed and removed["at"] < STEPS - 5, removed
    assert len(rows) == 2
    head = spot_cluster.head_node_id
    hit = 0
    for r in rows:
        assert r["state"] == "finished" and r["steps"] == STEPS, r
        assert r["restarts"] == 0 and r["resumed_from"] == [], r  # no trial restarted, from scratch or otherwise
        starts = [e for e in read_jsonl(os.path.join(r["run_dir"], "events.jsonl")) if e["event"] == "tune_trial"]
        assert len(starts) == 1 and starts[0]["node"] == head  # the driver held on-demand capacity
        events = read_jsonl(os.path.join(r["run_dir"], "events.jsonl"))
        plan = next(e for e in events if e["event"] == "plan")["assignments"]
        assert {a["market"] for a in plan if a["role"] == "grad_worker"} == {"spot"}
        assert [m["step"] for m in read_jsonl(os.path.join(r["run_dir"], "metrics.jsonl"))] == list(range(1, STEPS + 1))
        lost = [e for e in events if e["event"] == "eviction" and e["node"] == removed["node"]]
        hit += bool(lost)
        if notice_s:
            assert [e["node"] for e in events if e["event"] == "NodeLeaving"] == [removed["node"]]
    assert hit >= 1  # the removed node held workers of at least one trial, and they were replaced in the trial
