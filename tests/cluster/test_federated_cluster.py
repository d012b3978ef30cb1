"""``federated`` on the simulated spot cluster: client actors on spot nodes, one node
preempted with notice (its actors leave before it does, so no round loses a client to
it) and one removed without notice (only the round in flight loses the clients it held)."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.jobs.federated import FederatedConfig, FederatedWorkload

from harness import drive  # tests/harness.py
from market_helpers import notice_then_remove, wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]


def test_federated_clients_on_spot_through_a_notice_and_a_hard_loss(spot_cluster, tmp_path):
    market = spot_cluster
    wait_all_free()
    conf = cfg.load_config(FederatedConfig, overrides=[
        "actors=4", "client_cpus=1", "clients_per_round=8", "alpha=0.5", "driver.max_steps=14", "driver.checkpoint_every_steps=4",
        "driver.progress=false", "driver.tensorboard=false", f"driver.runs_dir={tmp_path}", "driver.run_name=fed-spot"])
    workload = FederatedWorkload(conf)
    log: list[str] = []
    # Paced rounds: the notice (5 s) is seen at the next round boundary, long before its node goes.
    run = drive(workload, conf.driver, pace_s=0.5, during=notice_then_remove(market, log, notice_at=3, remove_at=8, notice_s=5.0), join_s=120)
    summary, events, rows = run.summary, run.events, run.metrics
    assert len(log) == 2 and summary["state"] == "finished" and summary["steps"] == 14, (log, summary)
    assert summary["failures_recovered"] == 0  # a lost client costs its round's update, never a rollback
    plan = next(e for e in events if e["event"] == "plan")["assignments"]
    # The plan fills spot first (4 x 1 CPU on the two spot nodes), then falls back to on-demand up to max_actors.
    assert [a["market"] for a in plan if a["role"] == "fed_client"][:4] == ["spot"] * 4, plan
    assert any(e["event"] == "NodeLeaving" for e in events)
    removed_at = int(log[1].rsplit(" ", 1)[1])  # step calls begun when the node was removed
    hit = {r["step"] for r in rows if r["lost"]}
    assert hit <= {removed_at, removed_at + 1}, (hit, log)  # the notice cost no round anything
    assert all(r["participants"] == 8 - r["lost"] - r["late"] and r["participants"] >= 1 for r in rows), rows
    assert [r["step"] for r in rows] == list(range(1, 15))  # every round once
    evicted = [e for e in events if e["event"] == "eviction" and e["role"] == "fed_client"]
    leaving = next(e for e in events if e["event"] == "NodeLeaving")
    moved = [e for e in evicted if e["node"] == leaving["node"]]
    assert len(moved) == 2 and all("preemption notice" in e["reason"] for e in moved), evicted  # moved off before the node went
    assert len(evicted) >= 3, evicted  # and the lost node's actors
    assert rows[-1]["accuracy"] > 0.5
