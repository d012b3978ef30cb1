"""The pool autoscaler inside a real run: GraphSAGE starts with one sampler that cannot keep
its (tiny, fast) trainer fed, and the driver grows the sampler pool on its own."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.driver import Driver
from raylane.jobs.graphsage import GraphSAGEConfig, GraphSAGEWorkload
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_a_starved_trainer_makes_the_sampler_pool_grow(ray_local, tmp_path):
    conf = cfg.load_config(GraphSAGEConfig, overrides=[
        # wide fan-outs and a tiny model: sampling costs far more than training
        "graph.nodes=4000", "graph.avg_degree=40", "fanouts=[30, 30]", "hidden=8", "batch_size=64", "batches_per_step=4",
        "epochs=3", "samplers=1", "max_samplers=3", "sampler_cpus=0.5", "prefetch=6",
        "driver.progress=false", "driver.tensorboard=false", f"driver.runs_dir={tmp_path}", "driver.run_name=auto",
        "driver.pool_autoscale=[{role: gnn_sampler, min: 1, max: 3, window_steps: 2, cooldown_s: 0}]",
    ])
    summary = Driver(GraphSAGEWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished", summary
    events = read_jsonl(tmp_path / "auto" / "events.jsonl")
    grows = [e for e in events if e["event"] == "autoscale" and e["target"] > e["previous"]]
    assert grows and "consumer waited" in grows[0]["reason"], [e for e in events if e["event"] == "autoscale"]
    targets = [r["pool/gnn_sampler/target"] for r in read_jsonl(tmp_path / "auto" / "metrics.jsonl")]
    assert targets[0] == 1 and max(targets) >= 2, targets  # the decision shows in the metrics too
    cov = [e for e in events if e["event"] == "epoch_coverage"]
    assert len(cov) == 3 and all(c["min_visits"] == c["max_visits"] == 1 for c in cov)  # growing lost nothing
