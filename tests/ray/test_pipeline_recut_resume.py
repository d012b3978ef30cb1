"""A pipeline run checkpointed on 3 stages (each stage writes its own layers) and resumed
on 2 goes on with the weights of the unsplit model: each new stage reads only the parts
that hold its layers."""

from __future__ import annotations

import json

import pytest

from raylane.checkpoint import CheckpointStore
from raylane.driver import Driver, DriverConfig
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig, PipelineLMWorkload
from raylane.runlog import read_jsonl

from pipeline_ref import check_close, final_params, reference  # tests/pipeline_ref.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_local")]

SHAPE = dict(seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=1)


def make(tmp_path, stages: int, steps: int) -> PipelineLMConfig:
    conf = PipelineLMConfig(model=ModelShape(**SHAPE), micro_batch_size=2, text_chars=20_000, stage_cpus=0.25, lr=5e-3, split="even",
                            stages=stages, schedule="gpipe", micro_batches=3)
    conf.driver = DriverConfig(run_name="recut", runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=2, progress=False, tensorboard=False)
    return conf


def test_a_pipeline_saved_on_3_stages_resumes_on_2_with_the_unsplit_models_weights(tmp_path):
    first = Driver(PipelineLMWorkload(make(tmp_path, 3, 4)), make(tmp_path, 3, 4).driver).run()
    assert first["state"] == "finished" and first["steps"] == 4
    store = CheckpointStore(str(tmp_path / "recut" / "checkpoints"))
    manifest = json.loads((tmp_path / "recut" / "checkpoints" / "0000000004" / "MANIFEST.json").read_text())
    parts = sorted(manifest["parts"])
    assert parts == ["workload.stages.0", "workload.stages.1", "workload.stages.2"], parts  # the driver held no layer
    _, state = store.load(4)
    assert sorted(i for ids in state["workload"]["held"].values() for i in ids) == list(range(6))

    conf = make(tmp_path, 2, 8)
    summary = Driver(PipelineLMWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["steps"] == 8 and summary["resumed_from"] == 4, summary
    events = read_jsonl(tmp_path / "recut" / "events.jsonl")
    assert [(e["saved_stages"], e["stages"]) for e in events if e["event"] == "pipeline_recut"] == [(3, 2)]
    want_losses, want_params = reference(conf, 8)
    got = [r["loss"] for r in read_jsonl(tmp_path / "recut" / "metrics.jsonl")]
    assert got == pytest.approx(want_losses, rel=1e-4)
    check_close(final_params(tmp_path / "recut"), want_params, SHAPE["d_model"])
