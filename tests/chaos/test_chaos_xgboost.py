"""Chaos for XGBoost with trainers on spot (``prefer_spot``): a trainer's node drained with
notice, later another removed without notice, each replaced. A driver step is one chunk
of rounds and is checkpointed, so a loss costs at most the chunk in flight."""

from __future__ import annotations

import pytest

from raylane.driver import Driver, DriverConfig
from raylane.jobs.xgboost import DataConfig, XGBoostJobConfig, XGBoostWorkload

from harness import drive  # tests/harness.py
from market_helpers import notice_then_remove, wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

ROUNDS, CHUNK = 60, 10


def make(tmp_path, name: str) -> XGBoostJobConfig:
    conf = XGBoostJobConfig(data=DataConfig(source="synthetic:classification", rows=60_000, num_features=10, seed=3), num_boost_round=ROUNDS,
                            checkpoint_every=CHUNK, trainers=2, prefer_spot=True, params={"eval_metric": ["logloss"]})
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), progress=False, tensorboard=False)
    return conf


def test_xgboost_through_a_seeded_spot_schedule(spot_cluster, tmp_path):
    market = spot_cluster
    wait_all_free()
    calm = Driver(XGBoostWorkload(conf := make(tmp_path, "calm")), conf.driver).run()
    assert calm["state"] == "finished"
    wait_all_free()
    conf = make(tmp_path, "chaos")
    workload = XGBoostWorkload(conf)
    log: list[str] = []

    # pace_s: chunks as long as on real data, so the schedule lands between and inside them
    run = drive(workload, conf.driver, pace_s=1.5, during=notice_then_remove(market, log, notice_at=2, remove_at=4), join_s=120)
    summary, events = run.summary, run.events
    assert len(log) == 2 and summary["state"] == "finished", (log, summary)
    assert any(e["event"] == "NodeLeaving" for e in events)  # the notice was seen as such
    assert summary["failures_recovered"] >= 1
    final = summary["final_metrics"]
    assert final["round"] == ROUNDS  # every round boosted once into the final model
    ckpt_rounds = []
    for e in events:
        if e["event"] == "checkpoint":
            ckpt_rounds.append(min(ROUNDS, e["step"] * CHUNK))
        if e["event"] == "xgboost_resume":
            # back to the newest checkpoint: at most the chunk in flight was lost
            assert e["round"] == ckpt_rounds[-1], (e, ckpt_rounds)
    # "the same model": every evaluation of the last round equal to the calm run's, to the bit
    assert {k: v for k, v in final.items() if k.startswith("eval-")} == {k: v for k, v in calm["final_metrics"].items() if k.startswith("eval-")}, (final, calm["final_metrics"])
