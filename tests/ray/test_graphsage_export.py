"""graphsage's trained GNN exported (``raylane export``) and loaded with
``raylane.api.load_model`` in a process where Ray never starts: with the run's own
full-neighbourhood evaluation it scores the run's held-out accuracies at the exported step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raylane import api
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_local")]

# As tests/ray/test_graphsage.py, two epochs: 3000 nodes, 1500 training seeds in two METIS parts, ~13 batches an epoch.
GRAPH = ["graph.nodes=3000", "batch_size=125", "batches_per_step=4", "epochs=2", "samplers=2", "prefetch=4"]

# In the new process: the run's graph built again from the same settings, the exported model
# applied as the trainer's evaluate() applies it (the in-neighbour sparse adjacency, float32
# features, no dropout), and once more with a plain [2, E] edge_index as a user would call it.
SCRIPT = """
import json, sys, numpy as np, ray, torch
from raylane import config as cfg
from raylane.actors.sage import adjacency
from raylane.api import load_model
from raylane.jobs.graphsage import GraphSAGEConfig, prepare

torch.set_num_threads(1)  # as the trainer actor (one CPU: Ray gives it one thread)
model = load_model(sys.argv[1])
g = prepare(cfg.load_config(GraphSAGEConfig, overrides=json.loads(sys.argv[2])))
x, y = torch.from_numpy(np.asarray(g.x)).float(), np.asarray(g.y)
targets = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
edge_index = torch.from_numpy(np.stack([np.asarray(g.indices, np.int64), targets]))
with torch.no_grad():
    exact = model(x, adjacency(g)).argmax(1).numpy()
    plain = model(x, edge_index).argmax(1).numpy()
assert not ray.is_initialized() and not model.training
acc = lambda p, idx: float((p[idx] == y[idx]).mean())
print(json.dumps({"val_acc": acc(exact, g.val_idx), "test_acc": acc(exact, g.test_idx), "plain_test_acc": acc(plain, g.test_idx),
                  "agree": float((exact == plain).mean()), "type": type(model).__name__}))
"""


@pytest.mark.parametrize("model", ["sage", "gcn", "gat", "gin"])
def test_the_exported_gnn_scores_the_runs_held_out_accuracy_without_ray(tmp_path, model):
    """Each PyG layer type, rebuilt from the export's JSON alone (gat: its heads; gin: its MLPs)."""
    settings = [*GRAPH, f"model={model}", *({"gat": ["hidden=64"], "gin": ["lr=1e-3"]}.get(model, []))]
    name = f"gnn-{model}"
    summary = api.run("graphsage", overrides=[*settings, f"driver.runs_dir={tmp_path}", "driver.progress=false", "driver.tensorboard=false"],
                      run_name=name)
    assert summary["state"] == "finished", summary
    run_dir = tmp_path / name
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["epochs_done"] == 2 and last["test_acc"] > 0.5, last  # trained: an untrained model is at ~1/8

    done = subprocess.run([sys.executable, "-m", "raylane", "export", name, "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exported to" in done.stdout, done.stdout + done.stderr
    folder = run_dir / "export"
    manifest = json.loads((folder / "export.json").read_text())
    assert manifest["job"] == "graphsage" and manifest["step"] == last["step"] and set(manifest["files"]) == {"model.pt"}, manifest
    gnn = manifest["model"]["gnn"]
    assert (gnn["kind"], gnn["in_dim"], gnn["classes"], gnn["layers"]) == (model, 32, 8, 2), gnn
    assert manifest["model"]["eval"] == {"val_acc": last["val_acc"], "test_acc": last["test_acc"]}

    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), json.dumps(settings)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["type"] == "GNN"
    # Exact: the same weights, features, adjacency and kernels as the trainer's evaluation.
    assert (got["val_acc"], got["test_acc"]) == (last["val_acc"], last["test_acc"]), (got, last)
    # A [2, E] edge_index aggregates in another order (float sums): the odd near-tie may flip.
    assert got["agree"] > 0.99 and got["plain_test_acc"] == pytest.approx(last["test_acc"], abs=0.01), got
