"""ps_ctr on a click log shaped like a user's (string user, ad and site ids with an effect each,
the hour, a price; :mod:`raylane.actors.click_log`): it says what it read, keeps its best step
when later steps overfit, stops early when asked, and with the settings the README gives for
sparse logs reaches scikit-learn's logistic regression on the same hashed columns; the kept
model, exported, scores the run's held-out AUC in a process where Ray never starts."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from raylane import api
from raylane.actors.click_log import write_click_log
from raylane.actors.ctr_files import describe_ctr, read_ctr_rows
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_local")]

ROWS, HELD_OUT = 60_000, 10_000


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clicks") / "log"
    write_click_log(folder, ROWS, files=3, seed=0)
    return folder


def run(clicks, tmp_path, name, *overrides) -> SimpleNamespace:
    """``raylane run ps_ctr`` as a user runs it (its record written, so it can be exported), on the test's Ray."""
    summary = api.run("ps_ctr", overrides=[f"data.path={clicks}", "data.label=clicked", f"eval_rows={HELD_OUT}", "shard_cpus=0.25",
                                           "worker_cpus=0.5", f"driver.runs_dir={tmp_path}", "driver.progress=false",
                                           "driver.tensorboard=false", *overrides], run_name=name)
    run_dir = tmp_path / name
    return SimpleNamespace(summary=summary, run_dir=run_dir, metrics=read_jsonl(run_dir / "metrics.jsonl"), events=read_jsonl(run_dir / "events.jsonl"))


def test_it_says_what_it_read_keeps_the_best_step_and_stops_when_the_auc_stops_improving(clicks, tmp_path):
    out = run(clicks, tmp_path, "overfits", "driver.max_steps=20", "driver.early_stop_patience=4")
    s = out.summary
    aucs = [r["auc"] for r in out.metrics]
    kept = s["best"]["kept"]
    assert s["state"] == "finished" and s["end_reason"].startswith("early stop: auc did not improve in 4 evaluations"), s
    assert len(aucs) == kept["step"] + 4 < 20  # four evaluations after the best, then it stopped
    assert kept["value"] == max(aucs) > aucs[-1]  # the later steps overfit; the best is what is kept
    read = next(e for e in out.events if e["event"] == "ctr_data")
    assert read["roles"] == {"clicked": "label", "user_id": "embedding field", "ad_id": "embedding field", "site_id": "embedding field",
                             "hour": "numeric (standardised)", "price": "numeric (standardised)"}
    assert (read["train_rows"], read["held_out_rows"]) == (ROWS - HELD_OUT, HELD_OUT)
    assert 0.15 < read["train_clicked"] / read["train_rows"] < 0.35 and read["train_clicked"] + read["held_out_clicked"] > 0

    # The kept model out of the run, into a process where Ray never starts: its held-out AUC is the run's.
    script = f"""
import json, sys, numpy as np, pyarrow.parquet as pq, ray
from sklearn.metrics import roc_auc_score
from raylane.api import load_model
model = load_model({str(out.run_dir)!r}, best=True)
held = pq.read_table({str(clicks)!r}).slice({ROWS - HELD_OUT})
p = model.predict(held.drop(["clicked"]))
assert not ray.is_initialized() and not model.training
print(json.dumps({{"auc": roc_auc_score(held["clicked"].to_numpy(), p), "n": len(p)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["n"] == HELD_OUT and got["auc"] == pytest.approx(kept["value"], abs=1e-6), (got, kept)
    manifest = json.loads((out.run_dir / "export-best" / "export.json").read_text())
    assert manifest["step"] == kept["step"] and manifest["best"] and set(manifest["files"]) == {"model.pt"}


def test_with_the_settings_for_sparse_logs_it_reaches_logistic_regression_on_the_same_columns(clicks, tmp_path):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    table = describe_ctr(str(clicks), label="clicked", standardize=True)
    ids, numeric, labels = read_ctr_rows(table, 10_000, 0, ROWS)
    train = ROWS - HELD_OUT
    cols = (ids[:, :, 0] + np.arange(3) * 10_000).ravel()
    onehot = sp.csr_matrix((np.ones(len(cols)), (np.repeat(np.arange(ROWS), 3), cols)), shape=(ROWS, 30_000))
    x = sp.hstack([onehot, sp.csr_matrix(numeric)]).tocsr()
    baseline = roc_auc_score(labels[train:], LogisticRegression(max_iter=2000).fit(x[:train], labels[:train]).decision_function(x[train:]))
    out = run(clicks, tmp_path, "sparse", "optimizer=sgd", "lr=3.0", "batch_size=1024", "driver.max_steps=25")
    best = out.summary["best"]["kept"]["value"]
    assert best >= baseline, (best, baseline)
