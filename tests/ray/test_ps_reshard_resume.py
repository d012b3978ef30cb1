"""A parameter-server run saved with 4 shards, resumed on 2 and then on 3, goes on with the
same parameters (every dense range and embedding row on the shard that now owns it) and
the same loss curve, to the bit, as the run that kept 4 shards throughout (sync mode)."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from raylane.driver import DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_local")]


def make(tmp_path, name: str, shards: int, steps: int) -> PSCTRConfig:
    conf = PSCTRConfig(rows=8_000, eval_rows=2_000, fields=3, buckets=1_000, workers=2, shards=shards, batch_size=128, clocks_per_step=3,
                       shard_cpus=0.25, worker_cpus=0.5, lr=0.1, mode="sync", optimizer="adam", wait_timeout_s=20.0)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=1, progress=False, tensorboard=False)
    return conf


def run(conf: PSCTRConfig) -> tuple[dict, list[dict]]:
    """The summary and every shard's state at the end."""
    workload = PSCTRWorkload(conf)
    final: list[dict] = []

    def keep():
        final.extend(ray.get([workload.shards[i].export_state.remote() for i in sorted(workload.shards)], timeout=60))

    return drive(workload, conf.driver, before_close=keep).summary, final


def whole(states: list[dict]) -> tuple[dict, dict]:
    """Dense tensors in order and rows by id, whatever the shard count."""
    dense = {n: np.concatenate([s["dense"][n] for s in states]) for n in states[0]["dense"]}
    rows = {}
    for t in states[0]["tables"]:
        ids = np.concatenate([s["tables"][t]["ids"] for s in states])
        order = np.argsort(ids)
        rows[t] = {k: np.concatenate([s["tables"][t][k] for s in states])[order] for k in states[0]["tables"][t]}
    return dense, rows


def losses(tmp_path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")}


def test_a_run_resumed_on_other_shard_counts_goes_on_as_if_unchanged(tmp_path):
    reference, ref_states = run(make(tmp_path, "kept", 4, 9))
    assert reference["state"] == "finished" and len(ref_states) == 4
    for shards, steps in ((4, 3), (2, 6), (3, 9)):
        summary, states = run(make(tmp_path, "recut", shards, steps))
        assert summary["state"] == "finished" and summary["steps"] == steps and len(states) == shards, summary
    events = read_jsonl(tmp_path / "recut" / "events.jsonl")
    assert [(e["saved_shards"], e["shards"]) for e in events if e["event"] == "ps_reshard"] == [(4, 2), (2, 3)]
    assert losses(tmp_path, "recut") == losses(tmp_path, "kept")
    assert summary["final_metrics"]["auc"] == reference["final_metrics"]["auc"]
    got, want = whole(states), whole(ref_states)
    assert all(np.array_equal(got[0][n], want[0][n]) for n in want[0])
    for t in want[1]:
        assert all(np.array_equal(got[1][t][k], want[1][t][k]) for k in want[1][t]), t
