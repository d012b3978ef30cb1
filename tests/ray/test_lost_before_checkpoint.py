"""A stateful rank lost after its step and before the checkpoint at that step boundary (its
node's loss is handled between the two: the driver evicts the node's actors, then asks the
workload for its state) is a recoverable loss, not a crash of the run: the shards go back to
the last checkpoint and the run ends as one without the loss (ps_ctr, sync mode)."""

from __future__ import annotations

import pytest
import ray

from raylane.driver import Driver, DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_local")]

STEPS = 6


def make(tmp_path, name: str) -> PSCTRConfig:
    conf = PSCTRConfig(rows=8_000, eval_rows=2_000, fields=3, buckets=1_000, workers=2, shards=2, batch_size=128, clocks_per_step=3,
                       shard_cpus=0.25, worker_cpus=0.5, lr=0.1, mode="sync", optimizer="adam", wait_timeout_s=20.0)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=STEPS, checkpoint_every_steps=1, progress=False, tensorboard=False)
    return conf


def test_shards_evicted_between_a_step_and_its_checkpoint_are_recovered_and_the_run_ends_exact(tmp_path):
    calm = drive(PSCTRWorkload(make(tmp_path, "calm")), make(tmp_path, "calm").driver)
    assert calm.summary["state"] == "finished", calm.summary

    conf = make(tmp_path, "boundary")
    workload = PSCTRWorkload(conf)
    driver = Driver(workload, conf.driver)
    own_state = workload.state_dict
    evicted: list[str] = []

    def state_dict():
        if driver.steps_done == 3 and not evicted:  # what the driver does on a NodeLost between the step and the checkpoint
            node = ray.get(workload.shards[1].where.remote(), timeout=30)["node"]
            ray.kill(workload.shards[1], no_restart=True)
            workload.shard_gang.evacuate(node, "node lost")
            evicted.append(node)
        return own_state()

    workload.state_dict = state_dict
    run = drive(workload, driver)
    assert evicted and run.summary["state"] == "finished" and run.summary["failures_recovered"] == 1, run.summary
    failure = next(e for e in run.events if e["event"] == "failure")
    assert failure["role"] == "param_shard" and "lost before their state was read" in failure["error"], failure
    restored = next(e for e in run.events if e["event"] == "restored")
    # The newest whole checkpoint (one node: no keeper holds a replica); that of step 2 is
    # written well before step 3 ends, but a part still being written would drop it.
    ckpts = [e["step"] for e in run.events[: run.events.index(restored)] if e["event"] == "checkpoint"]
    assert restored["step"] == max(ckpts) and 0 <= failure["step"] - restored["step"] <= 2, (restored, ckpts)
    exact = ("loss", "auc")
    assert {k: run.summary["final_metrics"][k] for k in exact} == {k: calm.summary["final_metrics"][k] for k in exact}


def test_a_rank_evicted_by_the_end_of_a_step_is_restored_at_that_boundary_not_used_again(tmp_path):
    """A rank that left its gang by the end of a step (its node was lost: the driver evicted
    it) is not used again, whatever its process still answers: the driver restores at that
    step boundary, before the checkpoint, and the run ends as one without the loss."""
    calm = drive(PSCTRWorkload(make(tmp_path, "calm2")), make(tmp_path, "calm2").driver)
    conf = make(tmp_path, "end-of-step")
    workload = PSCTRWorkload(conf)
    driver = Driver(workload, conf.driver)
    own_step = workload.step
    evicted: list[str] = []

    def step(i: int):
        out = own_step(i)
        if i == 3 and not evicted:  # what the driver's node reactions do on a NodeLost seen at this boundary
            node = ray.get(workload.shards[0].where.remote(), timeout=30)["node"]
            workload.shard_gang.evacuate(node, "node lost")
            evicted.append(node)
        return out

    workload.step = step
    run = drive(workload, driver)
    assert evicted and run.summary["state"] == "finished" and run.summary["failures_recovered"] == 1, run.summary
    failure = next(e for e in run.events if e["event"] == "failure")
    assert failure["role"] == "param_shard" and "were on a node that was lost by the end of step 4" in failure["error"], failure
    assert not [e for e in run.events if e["event"] == "checkpoint" and e["step"] == 4 and run.events.index(e) < run.events.index(failure)]
    exact = ("loss", "auc")
    assert {k: run.summary["final_metrics"][k] for k in exact} == {k: calm.summary["final_metrics"][k] for k in exact}
