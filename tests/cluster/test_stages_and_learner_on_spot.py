"""Pipeline stages and a PPO learner on spot nodes (``driver.stateful_market=spot``): each
writes its own checkpoint part and hands its snapshot to a keeper on another node every
step. The spot node of a stage, or of the learner, removed without notice mid-run is
restored from memory (the keeper's copy) with at most the step in flight run again, and
the pipeline ends with the weights of the unsplit model. The simulated cluster: an
on-demand head and two spot nodes."""

from __future__ import annotations

import pytest
import ray

from raylane.driver import Driver, DriverConfig
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig, PipelineLMWorkload
from raylane.jobs.ppo import PPOConfig, PPOWorkload

from harness import drive  # tests/harness.py
from market_helpers import wait_all_free  # tests/market_helpers.py
from pipeline_ref import check_close, final_params, reference  # tests/pipeline_ref.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

SHAPE = dict(seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=1)


def _driver(tmp_path, name: str, steps: int) -> DriverConfig:
    return DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=4, progress=False, tensorboard=False,
                        stateful_market="spot")


def _remove_node_of(market, driver: Driver, node_id: str, removed: list[str]) -> None:
    """Remove ``node_id`` (a spot node) without notice, once the replicas of the last step
    boundary have reached their keepers (the promise is the last replication that completed)."""
    holds = list(driver._ckpt.memory.holds.values())
    ray.wait(holds, num_returns=len(holds), timeout=30)
    [sim] = [s for s in market.spot_nodes() if s.node_id == node_id]
    removed.append(sim.name)
    market.remove(sim)


def _restored_from_memory(events: list[dict], part: str) -> None:
    restored = [e for e in events if e["event"] == "restored"]
    assert restored and restored[0]["source"] == "memory" and restored[0]["steps_rolled_back"] <= 1, restored
    source = next(e for e in events if e["event"] == "restore_source")
    assert source["parts"][part] == "peer", source  # the lost actor's state came from its keeper
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    assert ckpts and all(e.get("parts") for e in ckpts), ckpts  # written by the actors, not the driver
    assert not any(e["event"] == "checkpoint_parts_via_driver" for e in events)


def test_a_stages_spot_node_lost_restores_from_memory_and_ends_with_the_unsplit_weights(spot_cluster, tmp_path):
    wait_all_free()
    steps = 10
    conf = PipelineLMConfig(model=ModelShape(**SHAPE), micro_batch_size=2, text_chars=20_000, stage_cpus=0.5, lr=5e-3, split="even",
                            stages=2, schedule="gpipe", micro_batches=3, replace_timeout_s=5.0)
    conf.driver = _driver(tmp_path, "stage-lost", steps)
    workload = PipelineLMWorkload(conf)
    driver = Driver(workload, conf.driver)
    removed: list[str] = []

    def remove_stage_1s_node():
        node = ray.get(workload.layout.pipelines[0][1].where.remote(), timeout=30)["node"]
        _remove_node_of(spot_cluster, driver, node, removed)

    run = drive(workload, driver, at={6: remove_stage_1s_node})
    assert removed and run.summary["state"] == "finished" and run.summary["steps"] == steps, run.summary
    assert run.summary["failures_recovered"] >= 1
    plan = next(e for e in run.events if e["event"] == "plan")["assignments"]
    assert {a["market"] for a in plan if a["role"] == "pipeline_stage"} == {"spot"}, plan
    _restored_from_memory(run.events, "workload.stages.1")
    _, want = reference(conf, steps)
    check_close(final_params(run.run_dir), want, SHAPE["d_model"])


def test_a_learners_spot_node_lost_restores_it_from_memory(spot_cluster, tmp_path):
    wait_all_free()
    conf = PPOConfig(total_env_steps=24_000, target_return=None, workers=1, worker_cpus=0.5)
    conf.driver = _driver(tmp_path, "learner-lost", 100_000)
    workload = PPOWorkload(conf)
    driver = Driver(workload, conf.driver)
    removed: list[str] = []

    def remove_the_learners_node():
        node = ray.get(workload.learner.handles()[0].info.remote(), timeout=30)["node_id"]
        _remove_node_of(spot_cluster, driver, node, removed)

    run = drive(workload, driver, at={5: remove_the_learners_node})
    assert removed and run.summary["state"] == "finished" and run.summary["failures_recovered"] >= 1, run.summary
    plan = next(e for e in run.events if e["event"] == "plan")["assignments"]
    assert {a["market"] for a in plan if a["role"] == "learner"} == {"spot"}, plan
    _restored_from_memory(run.events, "workload.learner")
    assert run.summary["final_metrics"]["env_steps"] >= 24_000


def test_a_hot_spare_takes_over_the_learner_whose_spot_node_is_lost(spot_cluster, tmp_path):
    """``driver.hot_spares=1``: a second learner actor runs beside the one holding the rank;
    when the learner's node goes, the spare (already started) takes the rank and loads the
    keeper's copy: no replacement is waited for."""
    wait_all_free()
    conf = PPOConfig(total_env_steps=24_000, target_return=None, workers=1, worker_cpus=0.5)
    conf.driver = _driver(tmp_path, "learner-spare", 100_000)
    conf.driver.hot_spares = 1
    workload = PPOWorkload(conf)
    driver = Driver(workload, conf.driver)
    removed: list[str] = []
    seen: dict[str, list[str]] = {}

    def remove_the_learners_node():
        workload.learner.wait_for(2, timeout_s=120)  # the rank's actor and the spare
        [ranked] = workload.learner.handles().values()
        spares = [h for h in workload.learner.actors() if h._actor_id != ranked._actor_id]
        assert len(spares) == 1, spares
        node = ray.get(ranked.info.remote(), timeout=30)["node_id"]
        assert ray.get(spares[0].info.remote(), timeout=30)["node_id"] != node, "the spare was placed beside the learner"
        seen["spare"] = [spares[0]._actor_id.hex()]
        _remove_node_of(spot_cluster, driver, node, removed)

    def learner_at_the_end():
        seen["after"] = [h._actor_id.hex() for h in workload.learner.handles().values()]

    run = drive(workload, driver, at={5: remove_the_learners_node}, before_close=learner_at_the_end)
    assert removed and run.summary["state"] == "finished" and run.summary["failures_recovered"] >= 1, run.summary
    assert seen["after"] == seen["spare"], seen  # the running spare holds the rank now, not a new actor
    [spares] = [e for e in run.events if e["event"] == "hot_spares"]
    assert spares["roles"] == {"learner": {"spares": 1, "resources": {"CPU": 1.0}, "markets": ["spot"]}}, spares
    _restored_from_memory(run.events, "workload.learner")
