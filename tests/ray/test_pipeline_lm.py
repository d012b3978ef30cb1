"""``pipeline_lm`` end to end on a local Ray: the job trains the same weights as the
unsplit model in one process, and a stage killed mid-step is recovered from the last
checkpoint with the layers re-split, ending where an uninterrupted run ends."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import ray

from raylane import config as cfg
from raylane.driver import Driver, DriverConfig
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig, PipelineLMWorkload, PipelineWorkload

from harness import drive, gone  # tests/harness.py
from pipeline_ref import check_close, final_params, reference  # tests/pipeline_ref.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

SHAPE = dict(seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=1)


def make(tmp_path, name: str, steps: int, **kw) -> PipelineLMConfig:
    conf = PipelineLMConfig(model=ModelShape(**SHAPE), micro_batch_size=2, text_chars=20_000, stage_cpus=0.25, lr=5e-3, split="even", **kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=4, progress=False, tensorboard=False)
    return conf


def read(run_dir, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


@pytest.mark.parametrize("schedule, chunks, replicas, dispatch", [("interleaved", 2, 1, "linked"), ("1f1b", 1, 2, "driver")])
def test_job_trains_the_weights_of_the_unsplit_model(ray_local, tmp_path, schedule, chunks, replicas, dispatch):
    steps = 8
    conf = make(tmp_path, f"plm-{schedule}", steps, stages=2, schedule=schedule, chunks=chunks, replicas=replicas, dispatch=dispatch)
    summary = Driver(PipelineLMWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["steps"] == steps
    want_losses, want_params = reference(conf, steps)
    run = tmp_path / f"plm-{schedule}"
    got_losses = [m["loss"] for m in read(run, "metrics.jsonl")]
    assert got_losses == pytest.approx(want_losses, rel=1e-4)
    assert got_losses[-1] < got_losses[0] - 0.3  # it learns
    check_close(final_params(run), want_params, SHAPE["d_model"])
    layout = next(e for e in read(run, "events.jsonl") if e["event"] == "pipeline_layout")
    assert layout["stages"] == 2 and layout["replicas"] == replicas and layout["chunks"] == chunks
    final = json.loads((run / "final.json").read_text())
    assert final["val_loss"] < 4.0  # ln(96) = 4.56 untrained
    assert (run / "sample.txt").read_text().startswith("the cat ")


def test_a_stage_killed_mid_step_is_recovered_from_the_last_checkpoint(ray_local, tmp_path):
    steps, kill_at = 12, 9
    conf = make(tmp_path, "plm-kill", steps, stages=3, schedule="gpipe", micro_batches=4)
    workload = PipelineLMWorkload(conf)
    killed: list[str] = []
    victims: list = []

    def kill_a_stage():
        victim = workload.layout.pipelines[0][1]
        victims.append(victim)
        pid = ray.get(victim.where.remote(), timeout=30)["pid"]

        def kill():
            time.sleep(0.01)  # let the batch start on every stage
            ray.kill(victim, no_restart=True)
            killed.append(str(pid))

        threading.Thread(target=kill, daemon=True).start()

    # The kill is asynchronous: it has landed before step kill_at + 1 runs its batch.
    run = drive(workload, conf.driver, at={kill_at: kill_a_stage, kill_at + 1: lambda: gone(victims[0])})
    summary, seen = run.summary, run.steps
    assert killed and summary["state"] == "finished" and summary["steps"] == steps
    # The failing step is 9, or 10 if step 9 ended inside the 10 ms; either way the run
    # goes back to the checkpoint of step 8 and runs every step from there once more.
    failed = seen.index(8, 9)
    assert seen[:failed] == list(range(failed)) and failed - 1 in (kill_at, kill_at + 1)
    assert seen[failed:] == list(range(8, steps))
    events = run.events
    kinds = [e["event"] for e in events]
    assert kinds.count("pipeline_layout") >= 2 and "failure" in kinds
    relayout = [e for e in events if e["event"] == "pipeline_layout"][-1]
    assert relayout["stages"] == 3 and sorted(i for piece in relayout["pieces"] for ids in piece.values() for i in ids) == list(range(6))
    _, want_params = reference(conf, steps)
    check_close(final_params(run.run_dir), want_params, SHAPE["d_model"])


def test_pipeline_trains_the_users_layers_on_their_token_file_through_a_stage_kill(ray_local, tmp_path):
    """``raylane run pipeline`` on the user's own parts: layers from their factory (cut by
    measured cost, unchanged), token ids from a .npy file; a stage killed mid-run is
    recovered from the checkpoint, and the weights end as one process trains them."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "ids.npy", (np.cumsum(rng.integers(1, 3, 20_000)) % 37).astype(np.int32))  # a learnable sequence
    steps = 8
    conf = cfg.load_config(PipelineLMConfig, overrides=[
        "model.seq_len=16", "model.factory=lm_models:tiny_lm", f"data.path={tmp_path / 'ids.npy'}", "stages=2", "schedule=gpipe",
        "micro_batch_size=2", "stage_cpus=0.25", "lr=5e-3"])
    conf.driver = DriverConfig(run_name="byo", runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=4, progress=False, tensorboard=False)
    workload = PipelineWorkload(conf)
    killed = []
    victims: list = []

    def kill_a_stage():
        victim = workload.layout.pipelines[0][1]
        victims.append(victim)
        threading.Timer(0.01, lambda: (ray.kill(victim, no_restart=True), killed.append(1))).start()

    run = drive(workload, conf.driver, at={6: kill_a_stage, 7: lambda: gone(victims[0])})  # landed before the last step
    assert killed and run.summary["state"] == "finished" and run.summary["failures_recovered"] == 1, run.summary
    assert run.run_dir.name == "byo" and [e for e in run.events if e["event"] == "layer_costs"][0]["split"] == "measured"
    layout = [e for e in run.events if e["event"] == "pipeline_layout"][-1]
    assert sorted(i for piece in layout["pieces"] for ids in piece.values() for i in ids) == [0, 1, 2, 3]
    losses, want = reference(conf, steps)
    got = [m["loss"] for m in read(tmp_path / "byo", "metrics.jsonl")]
    assert got[-1] < got[0] - 0.3, got  # it learns
    check_close(final_params(run.run_dir), want, 16)
    assert json.loads((run.run_dir / "final.json").read_text())["val_loss"] < got[0]
    assert not (run.run_dir / "sample.txt").exists()  # token ids in: no text to sample


def test_the_layers_export_as_one_model_that_scores_the_runs_held_out_loss_without_ray(ray_local, tmp_path):
    """Driven from Python (no config.json: the checkpoint names its job and describes its
    model), exported with ``raylane export``, loaded in a process where Ray never starts."""
    import subprocess
    import sys

    conf = make(tmp_path, "plm-export", 4, stages=2, schedule="1f1b")
    summary = Driver(PipelineLMWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished"
    run = tmp_path / "plm-export"
    val_loss = json.loads((run / "final.json").read_text())["val_loss"]
    done = subprocess.run([sys.executable, "-m", "raylane", "export", str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "step 4 of run 'plm-export' exported" in done.stdout, done.stderr
    script = f"""
import json, torch, ray
from raylane.actors import corpus, gpt
from raylane.api import load_model
from raylane.jobs.pipeline_lm import ModelShape, PipelineLMConfig
model = load_model({str(run / "export")!r})
conf = PipelineLMConfig(model=ModelShape(**{SHAPE!r}), text_chars=20_000)
_, val = corpus.split(conf.inputs()[0].ids, conf.val_fraction)
x, y = corpus.eval_windows(val, conf.model.seq_len, limit=64)
with torch.no_grad():
    loss = float(gpt.loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)))
assert not ray.is_initialized() and not model.training and len(model) == {SHAPE["n_blocks"] + 2}
print(json.dumps({{"val_loss": loss}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["val_loss"] == pytest.approx(val_loss, abs=1e-6)
    manifest = json.loads((run / "export" / "export.json").read_text())
    assert manifest["job"] == "pipeline_lm" and manifest["model"]["kind"] == "gpt" and set(manifest["files"]) == {"model.pt"}
