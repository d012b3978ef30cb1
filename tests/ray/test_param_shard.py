"""Parameter shards on a local Ray: sync with one worker equals single-process training,
async and SSP converge, SSP never exceeds its bound, a retried push is applied once, and
a shard killed mid-training is restored alone with the run ending where a fault-free one
does."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import ray
import torch

from raylane.actors import ctr
from raylane.actors.param_shard import ParamShard, ShardConfig
from raylane.actors.ps_layout import dense_slices, init_rows
from raylane.actors.ps_worker import PSWorker, WorkerConfig
from raylane.driver import Driver, DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

SHAPE = ctr.CTRShape(fields=3, ids_per_field=2, buckets=200, dense_features=4, embedding_dim=4, hidden=8)
LR, SCALE, SEED = 0.1, 0.05, 0


def start(mode: str, shards: int, workers: int, rows: int = 2000, batch: int = 64, staleness: int = 0, optimizer: str = "adagrad"):
    sizes = {n: int(np.prod(s)) for n, s in ctr.dense_shapes(SHAPE).items()}
    slices = dense_slices(sizes, shards)
    tables = {ctr.table_name(f): SHAPE.embedding_dim for f in range(SHAPE.fields)}
    hs = [ParamShard.options(num_cpus=0.25).remote() for _ in range(shards)]
    ray.get([h.setup.remote(ShardConfig(i, shards, workers, slices[i], tables, mode, staleness, optimizer, LR, SCALE, SEED, 30.0)) for i, h in enumerate(hs)], timeout=60)
    flat = {n: v.reshape(-1) for n, v in ctr.init_dense(SHAPE, SEED).items()}
    ray.get([h.init_dense.remote({n: flat[n][a:b] for n, (a, b) in slices[i].items()}) for i, h in enumerate(hs)], timeout=60)
    ws = [PSWorker.options(num_cpus=0.25).remote() for _ in range(workers)]
    per = rows // workers
    ray.get([w.setup.remote(WorkerConfig(k, SHAPE, (k * per, (k + 1) * per), shards, batch, SEED, SEED, 60.0)) for k, w in enumerate(ws)], timeout=60)
    ray.get([w.connect.remote(hs) for w in ws], timeout=60)
    return hs, ws


def reference_losses(clocks: int, rows: int = 2000, batch: int = 64) -> list[float]:
    """The same training in one process: whole tables as dense tensors, torch's Adagrad
    (rows with no gradient do not move, as on the shards)."""
    ids_all, numeric_all, labels_all = ctr.rows(SHAPE, SEED, 0, rows)
    dense = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in ctr.init_dense(SHAPE, SEED).items()}
    tables = {ctr.table_name(f): torch.nn.Parameter(torch.from_numpy(init_rows(SEED, ctr.table_name(f), np.arange(SHAPE.buckets), SHAPE.embedding_dim, SCALE)))
              for f in range(SHAPE.fields)}
    opt = torch.optim.Adagrad(list(dense.values()) + list(tables.values()), lr=LR)
    out = []
    for clock in range(clocks):
        pick = ctr.batch_rows(rows, batch, seed=SEED, worker=0, clock=clock)
        ids = ids_all[pick]
        uniq, inv = ctr.unique_ids(ids)
        rows_by = {ctr.table_name(f): tables[ctr.table_name(f)][torch.from_numpy(u)] for f, u in enumerate(uniq)}
        loss = ctr.loss_fn(ctr.forward(SHAPE, dense, rows_by, inv, torch.from_numpy(numeric_all[pick])), torch.from_numpy(labels_all[pick]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def kill_all(*groups):
    for g in groups:
        for h in g:
            ray.kill(h)


def test_sync_with_one_worker_equals_single_process_training(ray_local):
    hs, ws = start("sync", shards=2, workers=1)
    got = ray.get(ws[0].run.remote(0, 15), timeout=120)["losses"]
    assert got == pytest.approx(reference_losses(15), rel=1e-4, abs=1e-6)
    assert got[-1] < got[0]
    kill_all(hs, ws)


def test_ssp_never_lets_a_worker_exceed_the_bound(ray_local):
    s = 2
    hs, ws = start("ssp", shards=2, workers=2, staleness=s)
    t0 = time.monotonic()
    fast = ws[0].run.remote(0, 12)
    time.sleep(1.5)  # the other worker starts late: the fast one must wait at clock s + 1
    slow = ws[1].run.remote(0, 12)
    ray.get([fast, slow], timeout=120)
    fast_done = time.monotonic() - t0
    logs = [entry for h in hs for entry in ray.get(h.clock_log.remote(), timeout=30)]
    ahead = [clock - slowest for _, clock, slowest in logs]
    assert len(logs) == 2 * 2 * 12 and max(ahead) <= s
    assert max(ahead) == s  # the bound was reached, and held
    assert fast_done >= 1.4  # the fast worker waited for the late one
    kill_all(hs, ws)


def test_a_retried_push_is_applied_once(ray_local):
    hs, ws = start("async", shards=1, workers=1)
    twin, twin_ws = start("async", shards=1, workers=1)
    ids = {ctr.table_name(0): np.array([3, 5])}
    grads = ({n: np.full(b - a, 0.5, np.float32) for n, (a, b) in dense_slices({n: int(np.prod(sh)) for n, sh in ctr.dense_shapes(SHAPE).items()}, 1)[0].items()},
             {ctr.table_name(0): (np.array([3, 5]), np.ones((2, SHAPE.embedding_dim), np.float32))})
    assert ray.get(hs[0].push.remote(0, 0, *grads), timeout=30) is True
    assert ray.get(hs[0].push.remote(0, 0, *grads), timeout=30) is False  # the retry
    assert ray.get(twin[0].push.remote(0, 0, *grads), timeout=30) is True
    a, b = ray.get(hs[0].read.remote(ids), timeout=30), ray.get(twin[0].read.remote(ids), timeout=30)
    assert all(np.array_equal(a[0][n], b[0][n]) for n in a[0]) and np.array_equal(a[1][ctr.table_name(0)], b[1][ctr.table_name(0)])
    assert ray.get(hs[0].stats.remote(), timeout=30)["duplicates"] == 1
    kill_all(hs, ws, twin, twin_ws)


def test_feature_ids_of_the_wrong_type_are_refused_by_the_shard(ray_local):
    hs, ws = start("async", shards=1, workers=1)
    with pytest.raises(Exception, match="feature ids must be integers, got dtype float64"):
        ray.get(hs[0].pull.remote(0, 0, {ctr.table_name(0): np.array([1.5])}), timeout=30)
    kill_all(hs, ws)


def job(tmp_path, name: str, mode: str, steps: int, **kw) -> PSCTRConfig:
    conf = PSCTRConfig(rows=40_000, eval_rows=5_000, fields=4, buckets=2_000, mode=mode, workers=2, shards=2, batch_size=256,
                       clocks_per_step=10, shard_cpus=0.25, worker_cpus=0.25, lr=0.1, **kw)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=3, progress=False, tensorboard=False)
    return conf


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_converge(ray_local, tmp_path, mode):
    conf = job(tmp_path, mode, mode, 6, staleness=2)
    summary = Driver(PSCTRWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["final_metrics"]["auc"] > 0.72, summary["final_metrics"]


def test_a_shard_killed_mid_training_is_restored_alone_and_the_auc_holds(ray_local, tmp_path):
    steps = 10
    clean = job(tmp_path, "clean", "sync", steps)
    reference = Driver(PSCTRWorkload(clean), clean.driver).run()
    conf = job(tmp_path, "faulted", "sync", steps)
    workload = PSCTRWorkload(conf)
    original = workload.step
    killed: list[int] = []

    def step(i):
        if i == 7 and not killed:  # the checkpoint is at step 6: this step and the last one run again
            victim = workload.shards[1]
            killed.append(ray.get(victim.stats.remote(), timeout=30)["pid"])
            threading.Timer(0.2, lambda: ray.kill(victim, no_restart=True)).start()
        return original(i)

    workload.step = step
    summary = Driver(workload, conf.driver).run()
    assert killed and summary["state"] == "finished" and summary["failures_recovered"] >= 1
    events = [json.loads(line) for line in (tmp_path / "faulted" / "events.jsonl").read_text().splitlines()]
    restores = [e["shards"] for e in events if e["event"] == "ps_restore"]
    assert restores == [[1]]  # only the lost shard went back to the checkpoint
    assert abs(summary["final_metrics"]["auc"] - reference["final_metrics"]["auc"]) <= 0.005, (summary["final_metrics"], reference["final_metrics"])
