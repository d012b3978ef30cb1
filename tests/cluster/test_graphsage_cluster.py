"""GraphSAGE on the simulated spot cluster: the trainer on the on-demand head, samplers on
spot nodes; a spot node with samplers on it is removed without notice mid-epoch."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.jobs.graphsage import GraphSAGEConfig, GraphSAGEWorkload

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]


def test_graphsage_finishes_every_epoch_exactly_once_through_a_spot_node_loss(spot_cluster, tmp_path):
    conf = cfg.load_config(GraphSAGEConfig, overrides=[
        "graph.nodes=3000", "batch_size=125", "batches_per_step=2", "epochs=5", "samplers=2", "sampler_cpus=1",
        "prefetch=4", "driver.progress=false", "driver.tensorboard=false", f"driver.runs_dir={tmp_path}", "driver.run_name=gnn-spot",
    ])
    workload = GraphSAGEWorkload(conf)
    removed = {}

    def chaos(steps):
        steps.wait(9, poll_s=0.01)  # mid-epoch 1
        status = workload.samplers.status()
        nodes, removed["markets"] = status.nodes, status.markets
        victim = next(n for n in spot_cluster.nodes.values() if n.node_id in nodes)
        removed["name"], removed["at_step"] = victim.name, steps[-1]
        spot_cluster.remove(victim)  # no notice

    run = drive(workload, conf.driver, during=chaos, join_s=60)
    summary, events, steps = run.summary, run.events, run.steps
    assert "name" in removed and summary["state"] == "finished", summary
    assert summary["failures_recovered"] == 0  # samplers are stateless: nothing to restore
    assert summary["final_metrics"]["test_acc"] >= 0.85
    plan = next(e for e in events if e["event"] == "plan")["assignments"]
    assert [a["market"] for a in plan if a["role"] == "gnn_trainer"] == ["on-demand"]
    assert removed["markets"] == {"spot": 2}  # samplers prefer spot capacity
    cov = [e for e in events if e["event"] == "epoch_coverage"]
    assert len(cov) == 5 and all(c["min_visits"] == c["max_visits"] == 1 and c["visits_outside_train"] == 0 for c in cov)
    assert removed["at_step"] < len(steps) - 3  # the loss happened with epochs still to go
