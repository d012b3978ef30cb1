"""Chaos for GraphSAGE on the simulated spot cluster: a seeded schedule of spot losses
(a drain with notice, hard removals, two in a row, all spot capacity gone for a while and
back) while the job trains. Samplers live on spot, the trainer on the on-demand head."""

from __future__ import annotations

import time

import pytest

from raylane import config as cfg
from raylane.jobs.graphsage import GraphSAGEConfig, GraphSAGEWorkload
from raylane.runlog import read_jsonl

from harness import Steps, drive  # tests/harness.py

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

OVERRIDES = ["graph.nodes=12000", "batch_size=200", "batches_per_step=3", "epochs=6", "samplers=2", "sampler_cpus=1", "prefetch=4",
             "driver.progress=false", "driver.tensorboard=false", "driver.checkpoint_every_steps=5"]


def run(tmp_path, name: str, during=None) -> tuple[dict, GraphSAGEWorkload]:
    conf = cfg.load_config(GraphSAGEConfig, overrides=OVERRIDES + [f"driver.runs_dir={tmp_path}", f"driver.run_name={name}"])
    workload = GraphSAGEWorkload(conf)
    steps = Steps()
    over = steps.schedule_over

    def pace(i):
        # A step takes a fraction of a second here, so the run would end before the schedule
        # plays out: while it runs, steps are paced, and the last step waits for its end.
        if during is not None and workload.cursor + conf.batches_per_step >= workload.total_batches:
            assert over.wait(timeout=180), "the spot schedule did not finish"
        elif during is not None and not over.is_set():
            time.sleep(0.25)

    return drive(workload, conf.driver, during=during, steps=steps, join_s=120, before_step=pace).summary, workload


def test_graphsage_through_a_seeded_spot_schedule(spot_cluster, tmp_path):
    reference, _ = run(tmp_path, "calm")
    market = spot_cluster
    log: list[tuple[int, str]] = []

    def schedule(steps):
        # 1: a drain with a 6 s notice, the node then replaced
        steps.wait(6)
        victim = sorted(market.spot_nodes(), key=lambda n: n.name)[0]
        log.append((len(steps), f"notice {victim.name}"))
        market.preempt(victim, notice_s=6.0)  # longer than a step: the driver sees the notice at a step boundary
        market.add_node("spot", speed=victim.speed, cpus=2, name=victim.name)
        # 2 and 3: two hard removals in a row, then all spot capacity gone for a while
        steps.wait(len(steps) + 4)
        for victim in sorted(market.spot_nodes(), key=lambda n: n.name):
            log.append((len(steps), f"remove {victim.name}"))
            market.remove(victim)
        time.sleep(4.0)
        # 4: capacity back
        for name, speed in (("spot-slow", 1.0), ("spot-fast", 2.0)):
            market.add_node("spot", speed=speed, cpus=2, name=name)
        log.append((len(steps), "spot back"))

    summary, workload = run(tmp_path, "chaos", schedule)
    assert [what for _, what in log][-1] == "spot back", log
    assert summary["state"] == "finished", summary
    # Samplers are stateless and the trainer sits on on-demand capacity: no step is lost
    # or applied twice (step numbers run 1..N without a repeat), nothing needs recovering.
    rows = read_jsonl(tmp_path / "chaos" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert summary["failures_recovered"] == 0
    events = read_jsonl(tmp_path / "chaos" / "events.jsonl")
    cov = [e for e in events if e["event"] == "epoch_coverage"]
    assert len(cov) == 6 and all(c["min_visits"] == c["max_visits"] == 1 and c["visits_outside_train"] == 0 for c in cov)
    assert any(e["event"] == "NodeLeaving" for e in events)  # the notice was seen as such
    # The same batches (keys, sampled nodes and edges) in the same order as the fault-free
    # run: the trainer's digest of what it trained on agrees at every epoch's end.
    calm_cov = [e for e in read_jsonl(tmp_path / "calm" / "events.jsonl") if e["event"] == "epoch_coverage"]
    assert [c["trained_digest"] for c in cov] == [c["trained_digest"] for c in calm_cov]
    assert summary["final_metrics"]["batches"] == reference["final_metrics"]["batches"]
    # The same batches in the same order: the fault-free result to the bit, every step's loss too.
    exact = ("loss", "train_acc", "batches", "val_acc", "test_acc")
    assert {k: summary["final_metrics"][k] for k in exact} == {k: reference["final_metrics"][k] for k in exact}
    calm = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "calm" / "metrics.jsonl")}
    assert {r["step"]: r["loss"] for r in rows} == calm
    assert summary["final_metrics"]["test_acc"] >= 0.85
