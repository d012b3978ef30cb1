"""federated's global model exported (``raylane.api.export_run``) and loaded with
``raylane.api.load_model`` in a process where Ray never starts: on the server's held-out
rows it scores the run's accuracy at the exported round, for the digits and for a user's
table (whose feature columns the export names, in order)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raylane import api
from raylane.runlog import read_jsonl

from fed_tables import write_clients  # tests/fed_tables.py
from market_helpers import wait_all_free  # tests/market_helpers.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_local")]

# In the new process: the server's held-out rows read again from the same settings (as the
# workload reads them), and the exported model applied as the server's evaluation applies it.
SCRIPT = """
import json, sys, ray, torch
from raylane import config as cfg
from raylane.actors.fed_data import load
from raylane.api import load_model
from raylane.jobs.federated import FederatedConfig

model = load_model(sys.argv[1])
data = load(cfg.load_config(FederatedConfig, overrides=json.loads(sys.argv[2])).source())
with torch.no_grad():
    pred = model(torch.from_numpy(data.test_x)).argmax(1)
assert not ray.is_initialized() and not model.training
print(json.dumps({"accuracy": float((pred == torch.from_numpy(data.test_y)).float().mean()), "n": len(data.test_y), "inputs": model.inputs}))
"""


def run_and_load(tmp_path, name: str, settings: list[str]) -> tuple[dict, dict, dict]:
    """Train ``settings`` for a few rounds, export the newest checkpoint, load it elsewhere:
    (the run's last metrics row, export.json, what the other process measured)."""
    wait_all_free()  # the previous run's actors release their CPUs asynchronously
    summary = api.run("federated", overrides=[*settings, f"driver.runs_dir={tmp_path}", "driver.progress=false", "driver.tensorboard=false"],
                      run_name=name)
    assert summary["state"] == "finished", summary
    last = read_jsonl(tmp_path / name / "metrics.jsonl")[-1]
    folder = api.export_run(tmp_path / name)
    manifest = json.loads((folder / "export.json").read_text())
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), json.dumps(settings)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return last, manifest, json.loads(out.stdout.splitlines()[-1])


def test_the_digits_model_scores_the_runs_held_out_accuracy_without_ray(tmp_path):
    last, manifest, got = run_and_load(tmp_path, "digits", ["alpha=0.5", "hidden=32", "driver.max_steps=15"])
    assert manifest["job"] == "federated" and manifest["step"] == last["step"] == 15 and set(manifest["files"]) == {"model.pt"}, manifest
    assert {k: manifest["model"][k] for k in ("in_dim", "hidden", "classes")} == {"in_dim": 64, "hidden": 32, "classes": 10}
    assert "digits" in got["inputs"] and last["accuracy"] > 0.5, (got, last)  # trained: an untrained model is at ~0.1
    # Exact: the same weights, rows and kernels as the server's evaluation.
    assert got["n"] == 359 and got["accuracy"] == last["accuracy"], (got, last)


def test_a_users_table_model_names_its_feature_columns_and_scores_the_runs_accuracy(tmp_path):
    folder = write_clients(tmp_path / "table", clients=8, alpha=None)
    settings = [f"data.path={folder}", "data.label=digit", "data.client_column=site", "clients_per_round=4", "driver.max_steps=5"]
    last, manifest, got = run_and_load(tmp_path, "table", settings)
    assert manifest["step"] == last["step"] == 5 and set(manifest["files"]) == {"model.pt"}, manifest
    assert got["inputs"] == manifest["model"]["inputs"] == {"features": [f"p{j}" for j in range(64)], "label": "digit", "missing": 0.0}
    assert got["accuracy"] == last["accuracy"] and last["accuracy"] > 0.5, (got, last)
