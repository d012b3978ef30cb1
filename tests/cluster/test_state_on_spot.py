"""Stateful roles on spot nodes (``driver.stateful_market=spot``): the parameter shards start
on spot capacity, each writes its own checkpoint part and hands a snapshot to a keeper on
another node every step. A shard's spot node removed without notice mid-run is restored
from memory (the keeper's copy; the survivor from its own snapshot) with at most the step
in flight run again; with the keepers gone too, from the store. Either way the run ends
(sync mode) bit-identical to the run without the loss. The simulated cluster: an
on-demand head and two spot nodes."""

from __future__ import annotations

import pytest
import ray

from raylane.driver import Driver, DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload

from harness import drive  # tests/harness.py
from market_helpers import wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

STEPS, EVERY = 8, 2


def make(tmp_path, name: str) -> PSCTRConfig:
    conf = PSCTRConfig(rows=20_000, eval_rows=4_000, fields=4, buckets=2_000, workers=2, shards=2, batch_size=256, clocks_per_step=5,
                       shard_cpus=0.5, worker_cpus=0.5, lr=0.1, mode="sync", wait_timeout_s=10.0)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=STEPS, checkpoint_every_steps=EVERY, progress=False,
                               tensorboard=False, stateful_market="spot")
    return conf


def test_shards_on_spot_lose_a_node_and_end_exact(spot_cluster, tmp_path):
    market = spot_cluster
    wait_all_free()
    calm = drive(PSCTRWorkload(make(tmp_path, "calm")), make(tmp_path, "calm").driver)
    assert calm.summary["state"] == "finished", calm.summary
    plan = next(e for e in calm.events if e["event"] == "plan")["assignments"]
    assert {a["market"] for a in plan if a["role"] == "param_shard"} == {"spot"}, plan
    assert all(a["reason"] == "stateful role prefers spot (as set)" for a in plan if a["role"] == "param_shard")
    wait_all_free()

    for name, lose_keepers in (("lost", False), ("lost-with-keepers", True)):
        wait_all_free()
        lost, removed = run_losing_a_shard(market, make(tmp_path, name), lose_keepers)
        assert removed and lost.summary["state"] == "finished", lost.summary
        assert lost.summary["failures_recovered"] >= 1
        restores = [e for e in lost.events if e["event"] == "ps_restore"]
        assert restores and all(sorted(e["shards"]) == [0, 1] for e in restores), restores
        # Every checkpoint the shards wrote themselves, a part each, and none went through the driver.
        ckpts = [e for e in lost.events if e["event"] == "checkpoint"]
        assert ckpts and all(e.get("parts") == 2 for e in ckpts), ckpts
        assert not any(e["event"] == "checkpoint_parts_via_driver" for e in lost.events)
        [restored] = [e for e in lost.events if e["event"] == "restored"][:1]
        if lose_keepers:  # the copies went with the keepers: the store's newest checkpoint
            assert restored["source"] == "store" and restored["steps_rolled_back"] <= EVERY, restored
        else:  # from memory: the lost shard from its keeper, the survivor from its own snapshot
            assert restored["source"] == "memory" and restored["steps_rolled_back"] <= 1, restored
            [source] = [e for e in lost.events if e["event"] == "restore_source"][:1]
            assert source["parts"]["workload.shards.1"] == "peer", source
        exact = ("loss", "auc")
        assert {k: lost.summary["final_metrics"][k] for k in exact} == {k: calm.summary["final_metrics"][k] for k in exact}, name


def run_losing_a_shard(market, conf: PSCTRConfig, lose_keepers: bool):
    """The run, with shard 1's spot node removed without notice at step 5 (and, with
    ``lose_keepers``, every keeper killed first)."""
    workload = PSCTRWorkload(conf)
    driver = Driver(workload, conf.driver)
    removed: list[str] = []

    def remove_a_shards_node():
        # The replicas of the last step boundary have reached their keepers (the promise is
        # the last replication that completed; a copy still travelling falls back to the store).
        holds = list(driver._ckpt.memory.holds.values())
        ray.wait(holds, num_returns=len(holds), timeout=30)
        if lose_keepers:
            for keeper in driver._ckpt.keepers.by_node.values():
                ray.kill(keeper, no_restart=True)
        node = ray.get(workload.shards[1].where.remote(), timeout=30)["node"]
        [sim] = [s for s in market.spot_nodes() if s.node_id == node]
        removed.append(sim.name)
        market.remove(sim)

    return drive(workload, driver, at={5: remove_a_shards_node}), removed
