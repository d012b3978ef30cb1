"""Chaos for the parameter server: workers on spot nodes (shards on the on-demand head), one
spot node drained with notice, then the other removed without notice, each coming back.
Sync mode, so every clock must be applied exactly once on every shard: the shards' update
counts equal the clocks run, whatever was lost and replayed."""

from __future__ import annotations

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload

from harness import Driven, drive  # tests/harness.py
from market_helpers import notice_then_remove, wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

STEPS, CLOCKS, EVERY = 10, 10, 2


def make(tmp_path, name: str) -> PSCTRConfig:
    conf = PSCTRConfig(rows=40_000, eval_rows=5_000, fields=4, buckets=2_000, workers=2, shards=2, batch_size=256, clocks_per_step=CLOCKS,
                       shard_cpus=0.5, worker_cpus=1.0, lr=0.1, mode="sync", wait_timeout_s=10.0)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=STEPS, checkpoint_every_steps=EVERY, progress=False, tensorboard=False)
    return conf


def run(conf: PSCTRConfig, slow: float = 0.0, during=None) -> tuple[Driven, list[dict]]:
    """``slow``: each step sleeps this long first, as long as on real data, so the schedule
    lands between and inside them."""
    workload = PSCTRWorkload(conf)
    shard_stats: list[dict] = []

    def keep_stats():
        import ray

        if workload.shards:
            shard_stats.extend(ray.get([workload.shards[i].stats.remote() for i in sorted(workload.shards)], timeout=60))

    return drive(workload, conf.driver, during=during, pace_s=slow, before_close=keep_stats, join_s=120), shard_stats


def test_ps_through_a_seeded_spot_schedule(spot_cluster, tmp_path):
    market = spot_cluster
    wait_all_free()
    calm = run(make(tmp_path, "calm"))[0].summary
    assert calm["state"] == "finished"
    wait_all_free()
    log: list[str] = []

    chaos, stats = run(make(tmp_path, "chaos"), slow=1.0, during=notice_then_remove(market, log, notice_at=3, remove_at=6))
    summary, events, steps = chaos.summary, chaos.events, chaos.steps
    assert len(log) == 2 and summary["state"] == "finished", (log, summary)
    assert any(e["event"] == "NodeLeaving" for e in events)
    # No clock applied twice or skipped: sync applies each clock once per shard.
    assert [s["updates"] for s in stats] == [STEPS * CLOCKS] * 2, stats
    # A loss without notice costs at most the steps since the last checkpoint; with notice, none.
    replayed = len(steps) - STEPS
    assert replayed <= EVERY * summary["failures_recovered"], (steps, summary["failures_recovered"])
    # sync mode promises the bits of a run without the losses: the same loss and AUC to the last digit
    exact = ("loss", "auc")
    assert {k: summary["final_metrics"][k] for k in exact} == {k: calm["final_metrics"][k] for k in exact}, (summary["final_metrics"], calm["final_metrics"])
