"""pipeline_lm on a simulated 3-node cluster (an on-demand head and spot nodes
'spot-slow' (speed 1) and 'spot-fast' (speed 2), 2 CPUs each): layers follow node speed,
a node lost with no room for a replacement leaves the pipeline cut over fewer stages
from the last checkpoint, and when a node joins it is cut over more stages again, from
the live state; the run still ends with the weights of an uninterrupted one."""

from __future__ import annotations

import threading
import time

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig, PipelineLMWorkload

from harness import drive  # tests/harness.py
from market_helpers import by_name, wait_all_free  # tests/market_helpers.py
from pipeline_ref import check_close, final_params, reference  # tests/pipeline_ref.py

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def test_pipeline_shrinks_to_the_stages_that_fit_and_grows_back_with_exact_weights(spot_cluster, tmp_path):
    wait_all_free()
    steps = 36
    conf = PipelineLMConfig(
        model=ModelShape(seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=1), stages=3, schedule="gpipe", micro_batches=3,
        micro_batch_size=2, text_chars=20_000, stage_cpus=2, lr=5e-3, split="even", replace_timeout_s=3.0,
    )
    conf.driver = DriverConfig(run_name="plm-spot", runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=5, progress=False, tensorboard=False)
    workload = PipelineLMWorkload(conf)
    node_back = threading.Event()

    def hold_until_back():  # so the regrowth is observed
        assert node_back.wait(timeout=120)

    def wait_for_the_stage():  # on the returned node (a slow start must not end the run first)
        deadline = time.monotonic() + 120
        while len(workload.gang.actors()) < conf.stages and time.monotonic() < deadline:
            workload.gang.refresh()
            time.sleep(0.2)

    def chaos(steps):
        steps.wait(12, poll_s=0.02)
        spot_cluster.remove(by_name(spot_cluster, "spot-fast"))  # no notice; no room left for its stage
        steps.wait(22, poll_s=0.02)
        spot_cluster.add_node("spot", speed=2.0, cpus=2, name="spot-fast")
        node_back.set()

    result = drive(workload, conf.driver, at={24: hold_until_back, 30: wait_for_the_stage}, during=chaos, join_s=60)
    summary, events, run = result.summary, result.events, result.run_dir
    assert summary["state"] == "finished" and summary["steps"] == steps
    layouts = [e for e in events if e["event"] == "pipeline_layout"]
    first = layouts[0]
    assert first["stages"] == 3 and first["speeds"] == [2.0, 1.0, 1.0]
    assert len(first["pieces"][0]["0"]) >= 3  # the stage on the node twice as fast holds half the layers
    assert [lay["stages"] for lay in layouts][-2:] == [2, 3], [(lay["stages"], lay["speeds"]) for lay in layouts]
    assert any(e["event"] == "pipeline_grow" for e in events)
    assert any(e["event"] == "NodeLost" for e in events)
    _, want = reference(conf, steps)
    check_close(final_params(run), want, conf.model.d_model)
