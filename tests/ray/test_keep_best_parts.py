"""driver.keep_best on a job whose actors write their own checkpoint parts (ps_ctr's shards,
in the background): the best evaluation's checkpoint, parts and all, is kept apart from the
rotation once it commits, and it loads whole."""

from __future__ import annotations

import json

import pytest

from raylane.checkpoint import CheckpointStore
from raylane.driver import DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_local")]


def test_the_best_step_is_kept_with_every_shards_part_and_loads_whole(tmp_path):
    conf = PSCTRConfig(rows=6_000, eval_rows=2_000, fields=3, buckets=500, workers=2, shards=2, batch_size=128, clocks_per_step=2,
                       shard_cpus=0.25, worker_cpus=0.5, lr=0.5, mode="sync", optimizer="sgd", wait_timeout_s=20.0)
    conf.driver = DriverConfig(run_name="best", runs_dir=str(tmp_path), max_steps=8, checkpoint_every_steps=0, keep_checkpoints=1,
                               keep_best=True, best_metric="pull_wait_s", progress=False, tensorboard=False)
    run = drive(PSCTRWorkload(conf), conf.driver)
    assert run.summary["state"] == "finished", run.summary
    # A metric that goes up and down (the pulls' mean wait): its lowest step is kept, wherever it falls.
    waits = {r["step"]: r["pull_wait_s"] for r in run.metrics}
    best_step = next(s for s in sorted(waits) if waits[s] == min(waits.values()))  # the first step at the low: later equal ones do not improve
    kept = run.summary["best"]["kept"]
    assert (kept["step"], kept["value"]) == (best_step, waits[best_step]), (kept, waits)
    aucs = {r["step"]: r["auc"] for r in run.metrics}
    root = tmp_path / "best" / "checkpoints"
    assert CheckpointStore(str(root)).steps() == [8]  # the rotation keeps one; the best is apart
    store = CheckpointStore(str(root / "best"))
    step, state = store.load_whole()  # every part checked against the manifest and read
    assert step == best_step and state["workload"]["auc"] == aucs[best_step]
    assert set(state["workload"]["shards"]) == {"0", "1"} and all(isinstance(p, dict) and p for p in state["workload"]["shards"].values())
    assert json.loads((root / "best" / "BEST.json").read_text())["step"] == best_step
    kinds = [e["event"] for e in run.events]
    assert kinds.count("best_kept") >= 1 and "best_not_replaced" not in kinds
