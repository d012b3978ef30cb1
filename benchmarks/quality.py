"""How good a model raylane trains, against the single-machine tool a user would compare it with,
on data the benchmark generates with a known signal (so the best possible score is printed too).

``ps_ctr``: a click log shaped like a real one (string user, ad and site ids, the hour, a
price, a 0/1 label: :mod:`raylane.actors.click_log`), its last ``--eval-rows`` rows held out.
- (a) scikit-learn's ``LogisticRegression`` on the same hashed columns (one-hot of the ids'
  buckets as ps_ctr hashes them, the numbers standardised), at its default ``C=1`` and at the
  ``C`` that scores best on the held-out rows (optimistic: chosen on the rows it is scored on);
- (b) the same torch model trained in one process: ps_ctr's forward, its initial weights, the
  same batches in the same order (every worker's batch of a clock as one batch, as sync
  averaging makes it), torch's own optimizer with the same learning rate and weight decay;
- (c) ``raylane run ps_ctr`` on the Parquet files (2 shards, 2 workers, sync), with
  ``driver.keep_best``: the best step's AUC is what a user gets;
- the Bayes AUC: the true logits' AUC on the held-out rows.

    python benchmarks/quality.py [--jobs ps_ctr] [--rows 120000] [--steps 40] [--set lr=0.05 ...]
    python benchmarks/quality.py --log additive   # no interactions: the log a linear model fits as well as any
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def hashed(path: str, buckets: int, eval_rows: int):
    """The click log's rows as ps_ctr reads them: (ids, numeric standardised, labels, rows trained on)."""
    from raylane.actors.ctr_files import describe_ctr, read_ctr_rows

    table = describe_ctr(path, label="clicked", standardize=True)
    ids, numeric, labels = read_ctr_rows(table, buckets, 0, table.spec.rows)
    return table, ids, numeric, labels, table.spec.rows - eval_rows


def logistic(ids, numeric, labels, train: int, buckets: int) -> dict[float, float]:
    """Held-out AUC of scikit-learn's logistic regression per C, on one-hot hashed ids and the numbers."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    n, fields = ids.shape[0], ids.shape[1]
    cols = (ids[:, :, 0] + np.arange(fields) * buckets).ravel()
    onehot = sp.csr_matrix((np.ones(len(cols)), (np.repeat(np.arange(n), fields), cols)), shape=(n, fields * buckets))
    x = sp.hstack([onehot, sp.csr_matrix(numeric)]).tocsr()
    out = {}
    for c in (0.1, 0.3, 1.0, 3.0):
        model = LogisticRegression(C=c, max_iter=2000).fit(x[:train], labels[:train])
        out[c] = float(roc_auc_score(labels[train:], model.decision_function(x[train:])))
    return out


def one_process(conf, ids, numeric, labels, train: int, steps: int) -> list[float]:
    """Held-out AUC after each step of ps_ctr's model trained in this process on ps_ctr's batches."""
    import torch
    from sklearn.metrics import roc_auc_score

    from raylane.actors import ctr
    from raylane.actors.ps_layout import init_rows
    from raylane.placement import split_by_speed

    shape = ctr.CTRShape(ids.shape[1], ids.shape[2], conf.buckets, numeric.shape[1], conf.embedding_dim, conf.hidden)
    dense = {k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in ctr.init_dense(shape, conf.seed).items()}
    everyone = np.arange(conf.buckets)
    tables = {ctr.table_name(f): torch.nn.Parameter(torch.from_numpy(init_rows(conf.seed, ctr.table_name(f), everyone, conf.embedding_dim, conf.init_scale)))
              for f in range(shape.fields)}
    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[conf.optimizer]
    # Dense tensors decay at every update; an embedding row only when a batch touches it (below), as on the shards.
    opt = opt_cls([{"params": list(dense.values()), "weight_decay": conf.weight_decay}, {"params": list(tables.values()), "weight_decay": 0.0}], lr=conf.lr)
    bounds = np.cumsum([0] + split_by_speed(train, [1.0] * conf.workers)).tolist()
    x_eval = torch.from_numpy(numeric[train:])
    eval_uniq, eval_inv = ctr.unique_ids(ids[train:])
    aucs = []
    for step in range(steps):
        for clock in range(step * conf.clocks_per_step, (step + 1) * conf.clocks_per_step):
            pick = np.concatenate([bounds[w] + ctr.batch_rows(bounds[w + 1] - bounds[w], conf.batch_size, seed=conf.seed, worker=w, clock=clock)
                                   for w in range(conf.workers)])
            uniq, inv = ctr.unique_ids(ids[pick])
            rows = {ctr.table_name(f): tables[ctr.table_name(f)][torch.from_numpy(u)] for f, u in enumerate(uniq)}
            loss = ctr.loss_fn(ctr.forward(shape, dense, rows, inv, torch.from_numpy(numeric[pick])), torch.from_numpy(labels[pick]))
            opt.zero_grad()
            loss.backward()
            if conf.weight_decay:
                with torch.no_grad():
                    for f, u in enumerate(uniq):
                        t = tables[ctr.table_name(f)]
                        t.grad[u] += conf.weight_decay * t[u]
            opt.step()
        with torch.no_grad():
            rows = {ctr.table_name(f): tables[ctr.table_name(f)][torch.from_numpy(u)] for f, u in enumerate(eval_uniq)}
            logits = ctr.forward(shape, dense, rows, eval_inv, x_eval).numpy()
        aucs.append(float(roc_auc_score(labels[train:], logits)))
    return aucs


def raylane_run(path: str, overrides: list[str], runs: str) -> tuple[list[float], dict, float]:
    """Held-out AUC after each step of ``raylane run ps_ctr``, its summary and its wall time."""
    from raylane.api import run

    t0 = time.perf_counter()
    summary = run("ps_ctr", overrides=[f"data.path={path}", "data.label=clicked", "driver.keep_best=true", "driver.progress=false",
                                       "driver.tensorboard=false", f"driver.runs_dir={runs}"] + overrides, run_name="quality")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    return [r["auc"] for r in rows], summary, wall


def ps_ctr(args, tmp: Path) -> None:
    import ray

    from raylane.actors.click_log import ClickLogShape, bayes_auc, write_click_log
    from raylane.api import job_config

    shape = ClickLogShape() if args.log == "interactions" else replace(ClickLogShape(), affinity=0.0, match=0.0)
    overrides = [f"eval_rows={args.eval_rows}", f"driver.max_steps={args.steps}"] + list(args.set)
    conf = job_config("ps_ctr", overrides=[f"data.path={tmp}", "data.label=clicked"] + overrides)
    folder = tmp / "clicks"
    logit = write_click_log(folder, args.rows, seed=args.seed, shape=shape)
    table, ids, numeric, labels, train = hashed(str(folder), conf.buckets, args.eval_rows)
    bayes = bayes_auc(logit[train:], labels[train:])
    print(f"ps_ctr on a click log of {args.rows:,} rows ({args.log}; {labels.mean():.1%} clicked), the last {args.eval_rows:,} held out; "
          f"{conf.optimizer} lr={conf.lr} weight_decay={conf.weight_decay}, {args.steps} steps of {conf.clocks_per_step} clocks x "
          f"{conf.workers} workers x {conf.batch_size} rows")
    t0 = time.perf_counter()
    lr = logistic(ids, numeric, labels, train, conf.buckets)
    lr_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = one_process(conf, ids, numeric, labels, train, args.steps)
    alone_s = time.perf_counter() - t0
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        ours, summary, ours_s = raylane_run(str(folder), overrides, str(tmp / "runs"))
    finally:
        ray.shutdown()
    kept = summary["best"]["kept"]
    best_c = max(lr, key=lr.get)
    print(f"  Bayes (true logits)                          {bayes:.4f}")
    print(f"  logistic regression, C=1 (sklearn default)   {lr[1.0]:.4f}   ({lr_s:.1f} s for 4 values of C)")
    print(f"  logistic regression, best C={best_c:g} (optimistic)  {lr[best_c]:.4f}")
    print(f"  same model, one process: best {max(alone):.4f} at step {int(np.argmax(alone)) + 1}, last {alone[-1]:.4f}   ({alone_s:.1f} s)")
    print(f"  raylane ps_ctr: kept best {kept['value']:.4f} at step {kept['step']}, last {ours[-1]:.4f}   ({ours_s:.1f} s, start-up included)")
    print(f"  raylane best - LR(C=1) = {kept['value'] - lr[1.0]:+.4f}; raylane best - one process best = {kept['value'] - max(alone):+.4f}; "
          f"raylane best / Bayes = {kept['value'] / bayes:.3f}")
    print("  per step, one process: " + " ".join(f"{a:.3f}" for a in alone))
    print("  per step, raylane:     " + " ".join(f"{a:.3f}" for a in ours))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", nargs="+", default=["ps_ctr"], choices=["ps_ctr"])
    ap.add_argument("--rows", type=int, default=120_000)
    ap.add_argument("--eval-rows", type=int, default=20_000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", choices=["interactions", "additive"], default="interactions")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a ps_ctr key for both (b) and (c), e.g. lr=0.1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for job in args.jobs:
            {"ps_ctr": ps_ctr}[job](args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
