"""GraphSAGE on one local Ray: a fault-free run, a sampler killed mid-epoch, a trainer
killed mid-step, and a driver stopped and started again, all against the same reference."""

from __future__ import annotations

import json
import os
import signal

import pytest
import ray
import torch

from raylane import config as cfg
from raylane.driver import Driver
from raylane.jobs.graphsage import GraphSAGEConfig, GraphSAGEWorkload
from raylane.checkpoint import CheckpointStore
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# 3000 nodes, 1500 training seeds in two METIS parts, batches of 125: ~13 batches an epoch, 4 steps.
BASE = ["graph.nodes=3000", "batch_size=125", "batches_per_step=4", "epochs=4", "samplers=2", "prefetch=4",
        "driver.progress=false", "driver.tensorboard=false"]
THRESHOLD = 0.85  # test accuracy the generated graph must reach (an MLP on the features gets ~0.6)


def make(tmp_path, name: str, *overrides: str) -> tuple[GraphSAGEWorkload, Driver]:
    conf = cfg.load_config(GraphSAGEConfig, overrides=BASE + [f"driver.runs_dir={tmp_path}"] + list(overrides))
    conf.driver.run_name = name
    workload = GraphSAGEWorkload(conf)
    return workload, Driver(workload, conf.driver)


def coverage(tmp_path, name: str) -> list[dict]:
    return [e for e in read_jsonl(tmp_path / name / "events.jsonl") if e["event"] == "epoch_coverage"]


# What a run computes, step by step (timings and pool sizes left out).
EXACT = ("loss", "train_acc", "batches", "epoch", "nodes_per_batch", "val_acc", "test_acc", "epochs_done")


def per_step(run_dir) -> dict[int, dict]:
    """metrics.jsonl as {step: the EXACT values} (replayed steps: their final rows only)."""
    return {r["step"]: {k: r[k] for k in EXACT if k in r} for r in read_jsonl(run_dir / "metrics.jsonl")}


def final_trainer_state(run_dir) -> dict:
    return CheckpointStore(str(run_dir / "checkpoints")).load_whole()[1]["workload"]["trainer"]


@pytest.fixture(scope="module")
def reference_dir(ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gnn")
    _, driver = make(tmp, "reference")
    summary = driver.run()
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0
    return tmp / "reference"


@pytest.fixture(scope="module")
def reference(reference_dir):
    return json.loads((reference_dir / "summary.json").read_text())["final_metrics"]


def test_fault_free_run_learns_and_visits_every_seed_once_per_epoch(reference, tmp_path):
    assert reference["test_acc"] >= THRESHOLD, reference
    workload, driver = make(tmp_path, "again")
    per_epoch = len(workload.plan)  # ~13: each METIS part's ~750 seeds in batches of 125
    assert reference["epochs_done"] == 4 and reference["batches"] == 4 * per_epoch
    again = driver.run()["final_metrics"]
    assert again["test_acc"] == reference["test_acc"] and again["loss"] == reference["loss"]  # batches and order are fixed
    cov = coverage(tmp_path, "again")
    assert [c["epoch"] for c in cov] == [0, 1, 2, 3]
    assert all(c["min_visits"] == c["max_visits"] == 1 and c["visits_outside_train"] == 0 and c["train_nodes"] == 1500 for c in cov)


def test_a_sampler_killed_mid_epoch_is_replaced_and_the_epoch_completes(reference_dir, tmp_path):
    workload, driver = make(tmp_path, "samplerkill")
    killed: list[int] = []
    seen = []

    def kill_a_sampler():  # step 4 is mid-epoch 1; both samplers are busy prefetching
        pid = workload.samplers.call_all("info", timeout_s=30)[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    summary = drive(workload, driver, at={4: kill_a_sampler, 8: lambda: seen.append(workload.samplers.status())}).summary
    assert killed and summary["state"] == "finished" and summary["failures_recovered"] == 0, summary
    assert [e.reason for e in seen[0].evictions] == ["died during 'batch': ActorDiedError"], seen  # lost mid-call, not idle
    assert seen[0].target == 2 and seen[0].live + seen[0].starting == 2  # a replacement is on its way or serving
    cov = coverage(tmp_path, "samplerkill")
    assert len(cov) == 4 and all(c["min_visits"] == c["max_visits"] == 1 for c in cov)
    # The lost batch is made again identically: every step computes what the calm run computed.
    assert per_step(tmp_path / "samplerkill") == per_step(reference_dir)


@pytest.mark.parametrize("model", ["gcn", "gat", "gin"])
def test_each_gnn_layer_trains_through_a_sampler_kill_and_sees_every_seed_once(reference, tmp_path, model):
    """The other PyG layers ride the same samplers and recovery: a sampler killed
    mid-epoch costs no seed and no rollback, and the model clears the accuracy bar."""
    workload, driver = make(tmp_path, model, f"model={model}", *(["lr=1e-3"] if model == "gin" else []))

    def kill_a_sampler():
        os.kill(workload.samplers.call_all("info", timeout_s=30)[0]["pid"], signal.SIGKILL)

    summary = drive(workload, driver, at={4: kill_a_sampler}).summary
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0, summary
    cov = coverage(tmp_path, model)
    assert len(cov) == 4 and all(c["min_visits"] == c["max_visits"] == 1 for c in cov)
    assert summary["final_metrics"]["test_acc"] >= THRESHOLD, summary["final_metrics"]


@pytest.mark.parametrize("when", ["in_a_step", "between_steps"])
def test_a_killed_trainer_is_recovered_to_the_model_of_a_run_without_the_kill(reference_dir, tmp_path, when):
    """Killed while a step runs (calls of that step queued for it), or idle between two
    steps: the replacement is loaded from the checkpoint, no call of the failed step
    reaches it, and every step from the replay on computes what the run without the kill
    computed, to the bit, ending with the same weights, optimizer and random state."""
    workload, driver = make(tmp_path, "trainerkill", "driver.checkpoint_every_steps=2")
    trained = []

    def kill_trainer() -> None:
        handle = workload.trainer.actors()[0]
        os.kill(ray.get(handle.info.remote(), timeout=30)["pid"], signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):  # dead before the step goes on
            ray.get(handle.info.remote(), timeout=30)

    def kill(steps):
        steps.wait(6, poll_s=0.005)
        pid = workload.trainer.call_all("info", timeout_s=30)[0]["pid"]
        os.kill(pid, signal.SIGKILL)

    def count_trained() -> None:  # what the trainer itself trained on, not what the driver handed out
        trained.append(workload.trainer.call_one("info", timeout_s=60)["batches"])

    if when == "in_a_step":
        run = drive(workload, driver, during=kill, join_s=30, before_close=count_trained)
    else:
        run = drive(workload, driver, at={6: kill_trainer}, before_close=count_trained)
    summary, events, steps = run.summary, run.events, run.steps
    assert summary["state"] == "finished" and summary["failures_recovered"] == 1, summary
    failure = next(e for e in events if e["event"] == "failure")
    restored = next(e for e in events if e["event"] == "restored")
    # The newest checkpoint, the one in flight when the trainer died included (its snapshot
    # was taken before; the trainer had written its part), one of every 2 steps, from the store
    # (one node: no other node to keep a replica on).
    assert restored["source"] == "store" and restored["step"] % 2 == 0 and restored["step"] <= failure["step"], restored
    assert restored["step"] in [e["step"] for e in events if e["event"] == "checkpoint"]
    last, went_on = steps.rollback()  # the steps after the reload repeat from the checkpoint
    assert went_on == restored["step"] and last in (failure["step"] - 1, failure["step"]), (list(steps), failure)
    cov = coverage(tmp_path, "trainerkill")
    assert all(c["min_visits"] == c["max_visits"] == 1 for c in cov)  # position restored with the model
    assert trained == [summary["final_metrics"]["batches"]], (trained, summary["final_metrics"])
    # Every step, the replayed ones included, as the run without the kill computed it.
    got, want = per_step(tmp_path / "trainerkill"), per_step(reference_dir)
    assert sorted(got) == sorted(want)
    for step in sorted(want):
        assert got[step] == want[step], (step, got[step], want[step])
    a, b = final_trainer_state(tmp_path / "trainerkill"), final_trainer_state(reference_dir)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"] == b["optimizer"] and torch.equal(torch.as_tensor(a["rng"]), torch.as_tensor(b["rng"]))


def test_a_restarted_driver_resumes_at_its_epoch_and_position(reference, tmp_path):
    workload, first = make(tmp_path, "restart", "driver.max_steps=5", "driver.checkpoint_every_steps=100")
    s1 = first.run()
    per_epoch = len(workload.plan)
    stopped_at = s1["final_metrics"]["batches"]
    assert s1["state"] == "finished" and per_epoch < stopped_at < 2 * per_epoch  # stopped mid-epoch 1
    _, second = make(tmp_path, "restart")
    s2 = second.run()
    assert s2["resumed_from"] == 5 and s2["state"] == "finished"
    assert s2["final_metrics"]["batches"] == 4 * per_epoch
    rows = read_jsonl(tmp_path / "restart" / "metrics.jsonl")
    assert [r["batches"] for r in rows if r["step"] == 6][-1] == stopped_at + 4  # went on from the position
    # The very run the reference made: same model, optimizer, random state and position.
    assert s2["final_metrics"]["test_acc"] == reference["test_acc"] and s2["final_metrics"]["loss"] == reference["loss"]


def test_a_sampler_actor_making_two_batches_at_once_makes_the_in_process_ones(ray_local):
    import numpy as np
    import ray

    from raylane.actors.gnn_sampler import GNNSampler, GNNSamplerActor, SamplerConfig
    from raylane.actors.graph import sbm_graph, to_shared

    graph = to_shared(sbm_graph(3000, seed=3), 2, seed=3)
    sc = SamplerConfig((5, 3), 125, seed=3)
    actor = GNNSamplerActor.options(num_cpus=0).remote(sc, ray.put(graph))
    try:
        # Every call in flight at once: the actor runs two at a time, each with its own scratch.
        keys = [(e, p, i) for e in (0, 1) for p in (0, 1) for i in range(5)]
        got = ray.get([actor.batch.remote(*k) for k in keys], timeout=120)
        local = GNNSampler(sc, graph)
        for k, b in zip(keys, got):
            want = local.batch(*k)
            assert tuple(b["key"]) == k
            for name in ("n_id", "edge_index", "x", "y"):
                assert np.array_equal(b[name], want[name]), (k, name)
        # sample() walks its home part under a lock: one epoch's batches cover its seeds once.
        home = graph.train_seeds[0]
        n = -(-len(home) // sc.batch_size)
        seeds = np.concatenate([b["n_id"][: b["batch_size"]] for b in ray.get([actor.sample.remote() for _ in range(n)], timeout=120)])
        assert np.array_equal(np.sort(seeds), home)
        assert ray.get(actor.info.remote(), timeout=30)["batches"] == len(keys)
    finally:
        ray.kill(actor)
