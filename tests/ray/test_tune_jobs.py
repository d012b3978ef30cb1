"""``raylane tune`` of every registered job (slow, out of the default run: ``pytest -m slow``):
two trials each, three steps, one searched key; every trial finishes with a value of the
job's main metric, and every metric the job declares is one it reports."""

from __future__ import annotations

import os

import pytest

from raylane.runlog import read_jsonl
from raylane.tune.run import Search, tune
from raylane.tune.space import parse_search

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

COMMON = ["driver.tensorboard=false", "driver.control=false", "driver.max_steps=3"]
JOBS = {
    "linreg": (["lr=uniform(0.1,0.4)"], ["workers=1"]),
    "ppo": (["lr=loguniform(1e-4,3e-3)"], ["workers=1", "target_return=null"]),
    "impala": (["lr=loguniform(1e-4,3e-3)"], ["workers=1", "target_return=null", "plot=false"]),
    "graphsage": (["lr=loguniform(1e-3,1e-2)"], ["graph.nodes=3000", "samplers=1", "epochs=4"]),
    "xgboost": (["params.eta=uniform(0.1,0.5)"], ["trainers=2", "num_boost_round=6", "checkpoint_every=2", "threads=1"]),
    "pipeline_lm": (["lr=loguniform(1e-3,1e-2)"], ["stages=2", "stage_cpus=0.25"]),
    "ps_ctr": (["lr=loguniform(1e-3,1e-1)"], []),
    "federated": (["lr=loguniform(1e-3,1e-1)"], []),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_every_job_tunes_and_reports_what_it_declares(ray_tune, tmp_path, job):
    from raylane import registry
    from raylane.config import load_config
    from raylane.prepare import build as build_workload

    space, extra = JOBS[job]
    prep, rows, _ = tune(Search(job=job, space=parse_search(space), overrides=extra + COMMON, trials=2, concurrency=1,
                                runs_dir=str(tmp_path), name=job, seed=0), say=lambda m: None)
    assert len(rows) == 2 and all(r["state"] == "finished" and r["steps"] == 3 for r in rows), rows
    assert all(isinstance(r[f"best_{prep.metric}"], float) for r in rows), rows
    spec = registry.get(job)
    workload = build_workload(spec, load_config(spec.config_cls, overrides=extra + COMMON))
    declared = set(workload.metrics)
    workload.close()
    for r in rows:
        seen = {k for row in read_jsonl(os.path.join(r["run_dir"], "metrics.jsonl")) for k in row}
        assert declared <= seen, (job, sorted(declared - seen))
