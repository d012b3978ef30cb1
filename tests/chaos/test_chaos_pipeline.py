"""Chaos for pipeline stages: one stage per node (the on-demand head, spot-fast, spot-slow).
spot-fast is preempted with notice: its layers are handed to the other stages from the
live state before it goes (no failed step, no replay). spot-slow is then removed without
notice: the step fails, the layers are cut over the stages left and reloaded from the
last checkpoint (at most the checkpoint interval replayed). Each node comes back and the
pipeline grows onto it again. The final weights equal those of the same training done in
one process, so no step was lost or applied twice."""

from __future__ import annotations

import threading
import time

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig, PipelineLMWorkload

from harness import drive  # tests/harness.py
from market_helpers import by_name, wait_all_free  # tests/market_helpers.py
from pipeline_ref import check_close, final_params, reference  # tests/pipeline_ref.py

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

STEPS, EVERY = 70, 5


def test_pipeline_through_a_notice_and_a_loss_ends_with_exact_weights(spot_cluster, tmp_path):
    market = spot_cluster
    wait_all_free()
    conf = PipelineLMConfig(
        model=ModelShape(seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=3), stages=3, schedule="1f1b", micro_batches=3,
        micro_batch_size=2, text_chars=20_000, stage_cpus=2, lr=5e-3, split="even", replace_timeout_s=3.0,
    )
    conf.driver = DriverConfig(run_name="plm-chaos", runs_dir=str(tmp_path), max_steps=STEPS, checkpoint_every_steps=EVERY, progress=False, tensorboard=False)
    workload = PipelineLMWorkload(conf)
    log: list[str] = []
    removed = threading.Event()

    def hold():  # on a slow machine, keep the last steps for after the loss
        assert removed.wait(timeout=240), log

    def grown_back(timeout_s: float = 60.0) -> None:
        """The pipeline is cut over 3 stages again (the replacement stage joined it)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            lay = workload.layout
            if lay is not None and lay.sched.p == 3:
                return
            time.sleep(0.05)
        log.append("no regrowth in time")

    def schedule(steps):
        steps.wait(6)
        log.append(f"notice spot-fast at step {len(steps)}")
        market.preempt(by_name(market, "spot-fast"), notice_s=8.0)  # returns once the node is gone
        market.add_node("spot", speed=2.0, cpus=2, name="spot-fast")
        grown_back()
        log.append(f"remove spot-slow at step {len(steps)}")
        market.remove(by_name(market, "spot-slow"))
        removed.set()
        market.add_node("spot", speed=1.0, cpus=2, name="spot-slow")
        log.append(f"back at step {len(steps)}")

    # steps long enough (pace_s) for the schedule to land among them
    run = drive(workload, conf.driver, at={STEPS - 10: hold}, during=schedule, pace_s=0.25)
    summary, events, seen = run.summary, run.events, run.steps
    assert len(log) == 3 and log[-1].startswith("back") and summary["state"] == "finished" and summary["steps"] == STEPS, (log, summary)
    handoffs = [e for e in events if e["event"] == "pipeline_handoff"]
    assert [h["done"] for h in handoffs] == [True] and handoffs[0]["stages"] == 2, handoffs
    # The notice cost nothing: the only failure is the removal without notice, and it
    # replayed at most the checkpoint interval.
    assert summary["failures_recovered"] == 1, [e for e in events if e["event"] == "failure"]
    assert len(seen) - STEPS <= EVERY, (len(seen), log)
    layouts = [lay["stages"] for lay in (e for e in events if e["event"] == "pipeline_layout")]
    assert layouts[0] == 3 and layouts[1] == 2 and 3 in layouts[2:], layouts  # handed off to 2 stages, grown back to 3
    _, want = reference(conf, STEPS)
    check_close(final_params(run.run_dir), want, conf.model.d_model)
