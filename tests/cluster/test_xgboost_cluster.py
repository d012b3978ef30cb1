"""XGBoost trainers on a simulated 3-node cluster: an on-demand head (speed 1) and spot
nodes 'spot-slow' (speed 1) and 'spot-fast' (speed 2), real raylets throughout.

Trainers are a stateful role, so by default they plan onto the on-demand head. To see shard
sizes follow node speed they must land on the two spot nodes; the test asks for that with
``prefer_spot`` (the job's own switch for running trainers on spot capacity, where a
preemption costs at most one chunk), rather than by crowding the head, so what is checked is
the placement a user would get.
"""

from __future__ import annotations

import pytest

from raylane.cluster import ClusterView
from raylane.driver import Driver, DriverConfig
from raylane.jobs.xgboost import ROLE, DataConfig, XGBoostJobConfig, XGBoostWorkload
from raylane.placement import plan

from harness import drive, ranks_now  # tests/harness.py
from market_helpers import wait_all_free, by_name  # tests/market_helpers.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

DATA = {"source": "synthetic:classification", "rows": 150_000, "num_features": 12, "seed": 5}


def make(tmp_path, name: str, **kw) -> XGBoostJobConfig:
    conf = XGBoostJobConfig(data=DataConfig(**DATA), num_boost_round=30, checkpoint_every=10, trainers=2, params={"eval_metric": ["logloss"]}, **kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), progress=False, tensorboard=False)
    return conf


def test_trainers_plan_onto_on_demand_capacity_by_default(spot_cluster, tmp_path):
    wait_all_free()
    roles = XGBoostWorkload(make(tmp_path, "plan")).roles()
    assert roles[0].stateful
    assignments = plan(roles, ClusterView.from_ray()).for_role(ROLE)
    assert [a.node_id for a in assignments] == [spot_cluster.head_node_id] * 2


def test_spot_trainers_shard_by_speed_and_survive_a_node_removed_mid_chunk(spot_cluster, tmp_path):
    fast, slow = by_name(spot_cluster, "spot-fast"), by_name(spot_cluster, "spot-slow")
    wait_all_free()
    reference = Driver(XGBoostWorkload(conf := make(tmp_path, "reference", prefer_spot=True)), conf.driver).run()
    assert reference["state"] == "finished"

    wait_all_free()
    conf = make(tmp_path, "removed", prefer_spot=True)
    workload = XGBoostWorkload(conf)
    removed = []

    def remove_fast():
        # The group streams rounds 11-20 while the driver checkpoints round 10.
        removed.append(ranks_now(tmp_path / "removed", "xgboost_group", "nodes")[0])
        spot_cluster.remove(fast)  # without notice; returns once Ray marks the node dead

    run = drive(workload, conf.driver, at={1: remove_fast})  # the fixture adds spot-fast back for the next test
    summary, events = run.summary, run.events
    shards = next(e for e in events if e["event"] == "xgboost_shards")
    # Shard 0 (two thirds of the rows) went to the speed-2 node, shard 1 to the speed-1 node.
    assert shards["shards"] == [[0, 100_000], [100_000, 150_000]] and shards["speeds"] == [2.0, 1.0]
    first = next(e for e in events if e["event"] == "xgboost_group")
    assert first["nodes"] == {"0": fast.node_id, "1": slow.node_id}
    assert removed == [fast.node_id]

    assert summary["state"] == "finished" and summary["failures_recovered"] == 1, summary
    # It resumes from the last checkpoint before the failure: round 10, or round 20 when the
    # streamed chunk 11-20 was already home before the node went (timing of a loaded machine).
    failure = next(i for i, e in enumerate(events) if e["event"] == "failure")
    ckpts = [e["step"] for e in events[:failure] if e["event"] == "checkpoint"]
    resumes = [e["round"] for e in events if e["event"] == "xgboost_resume"]
    assert len(resumes) == 1 and resumes[0] in (10, 20) and resumes[0] == ckpts[-1] * 10, (resumes, ckpts)
    regroup = [e for e in events if e["event"] == "xgboost_group"][-1]
    assert regroup["loaded"] == [0] and regroup["kept"] == [1]  # only the lost shard was read again
    assert regroup["nodes"]["0"] != fast.node_id
    assert abs(summary["final_metrics"]["eval-logloss"] - reference["final_metrics"]["eval-logloss"]) < 1e-3
    assert (tmp_path / "removed" / "model.ubj").read_bytes() == (tmp_path / "reference" / "model.ubj").read_bytes()
