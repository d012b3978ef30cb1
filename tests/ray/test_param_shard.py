"""Parameter shards on a local Ray: sync with one worker equals single-process training,
SSP never exceeds its bound, a retried push is applied once; in the job, a shard or a
worker killed mid-run in sync mode ends bit-identical to the fault-free run, async and SSP
survive a shard loss with every (worker, clock) applied once, and a diverging run stops on
the driver's NaN guard, not in the AUC."""

from __future__ import annotations

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
from raylane.driver import DriverConfig, NonFiniteError
from raylane import config as cfg
from raylane.jobs.ps_ctr import SHARDS, WORKERS, PSCTRConfig, PSCTRWorkload
from raylane.runlog import read_jsonl

from ctr_tables import write_clicks  # tests/ctr_tables.py
from harness import drive, gone  # tests/harness.py

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


STEPS, CLOCKS, EVERY, KILL_AT = 10, 10, 3, 7  # checkpoint at step 6: steps 6 and 7 run again


def job(tmp_path, name: str, mode: str, steps: int = STEPS, **kw) -> PSCTRConfig:
    conf = PSCTRConfig(rows=40_000, eval_rows=5_000, fields=4, buckets=2_000, mode=mode, workers=2, shards=2, batch_size=256,
                       clocks_per_step=CLOCKS, shard_cpus=0.25, worker_cpus=0.25, **{"lr": 0.1, **kw})
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=EVERY, progress=False, tensorboard=False)
    return conf


def run(conf: PSCTRConfig, kill: str | None = None, at: int = KILL_AT) -> tuple[dict, dict, list[dict]]:
    """The run's summary, every shard's final state and its clock log. ``kill`` (a role)
    loses actor 1 of that role a moment into step ``at``, while the clocks are running."""
    workload = PSCTRWorkload(conf)
    final: dict = {}

    def kill_soon():
        victim = final["victim"] = (workload.shards if kill == SHARDS else workload.workers)[1]
        final["killed"] = True
        threading.Timer(0.2, lambda: ray.kill(victim, no_restart=True)).start()

    def killed():  # the kill is asynchronous (and on a timer): it has landed before the step after it starts
        gone(final["victim"])

    def keep_state():
        if workload.shards:
            final["shards"] = shard_states(workload)
            final["logs"] = [entry for i in sorted(workload.shards) for entry in ray.get(workload.shards[i].clock_log.remote(), timeout=60)]

    summary = drive(workload, conf.driver, at={at: kill_soon, at + 1: killed} if kill else None, before_close=keep_state).summary
    return summary, final["shards"], final["logs"]


def shard_states(workload: PSCTRWorkload) -> dict[str, dict]:
    """Every shard's state as it holds it now."""
    return {str(i): s for i, s in enumerate(ray.get([workload.shards[i].export_state.remote() for i in sorted(workload.shards)], timeout=60))}


def by_id(state: dict) -> dict:
    """A shard's state with every table's rows in id order (rows are stored in the order
    the pulls first touched them, which two workers' pulls decide by arrival)."""
    out = {k: v for k, v in state.items() if k != "tables"}
    for name, t in state["tables"].items():
        order = np.argsort(t["ids"], kind="stable")
        out[name] = {k: np.asarray(v)[order] for k, v in t.items()}
    return out


def assert_same_arrays(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            assert_same_arrays(a[k], b[k], f"{where}/{k}")
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b)), where


@pytest.fixture(scope="module")
def fault_free_sync(ray_local, tmp_path_factory):
    summary, shards, _ = run(job(tmp_path_factory.mktemp("clean"), "clean", "sync"))
    assert summary["state"] == "finished" and summary["failures_recovered"] == 0
    return summary, shards


@pytest.mark.parametrize("role", [SHARDS, WORKERS])
def test_an_actor_lost_mid_run_in_sync_mode_ends_bit_identical(ray_local, tmp_path, fault_free_sync, role):
    reference, clean_shards = fault_free_sync
    summary, shards, _ = run(job(tmp_path, "faulted", "sync"), kill=role)
    assert summary["state"] == "finished" and summary["failures_recovered"] >= 1, summary
    print(f"\nsync, {role} killed at step {KILL_AT}: auc {summary['final_metrics']['auc']!r} (fault-free {reference['final_metrics']['auc']!r})")
    for i in clean_shards:
        assert_same_arrays(by_id(shards[i]), by_id(clean_shards[i]), f"shard {i}")
    for key in ("auc", "loss"):
        assert summary["final_metrics"][key] == reference["final_metrics"][key], key
    events = read_jsonl(tmp_path / "faulted" / "events.jsonl")
    failures = [e for e in events if e["event"] == "failure"]
    assert failures and all(f["role"] == role for f in failures), failures
    restores = [e for e in events if e["event"] == "ps_restore"]
    if role == SHARDS:
        assert "parameter shard 1 lost" in failures[0]["error"], failures[0]
        assert [(e["shards"], e["replaced"]) for e in restores] == [([0, 1], [1])]  # all back to the checkpoint, one replaced
        assert [e["shards"] for e in events if e["event"] == "ps_lost"] == [[1]]
    else:
        # A lost worker costs the shards nothing, unless it died between its pushes of one
        # clock to the two shards: then their applied clocks differ and both go back.
        assert all(len(set(e["applied_clocks"].values())) > 1 and e["replaced"] == [] for e in restores), restores


def test_a_worker_lost_between_its_pushes_of_one_clock_rolls_every_shard_back(ray_local, tmp_path, fault_free_sync):
    """The hazard of a worker lost between pushing a clock to one shard and to the other,
    made certain: before step KILL_AT, clock KILL_AT * CLOCKS is completed on shard 0 alone
    (zero gradients from both workers), then worker 1 dies. The shards' applied clocks now
    differ, so recovery rolls both back to the checkpoint, and the run still ends
    bit-identical (kept as it was, shard 0 would skip that clock in the replay)."""
    reference, clean_shards = fault_free_sync
    conf = job(tmp_path, "split", "sync")
    workload = PSCTRWorkload(conf)
    final: dict = {}

    def split_then_kill():
        clock = KILL_AT * CLOCKS
        zeros = {name: np.zeros(b - a, np.float32) for name, (a, b) in workload.slices[0].items()}
        assert all(ray.get([workload.shards[0].push.remote(w, clock, zeros, {}) for w in (0, 1)], timeout=60))
        ray.kill(workload.workers[1], no_restart=True)
        gone(workload.workers[1])  # before the step: a kill landing late would let it push the clock to shard 1

    def keep_state():
        final["shards"] = shard_states(workload)

    summary = drive(workload, conf.driver, at={KILL_AT: split_then_kill}, before_close=keep_state).summary
    assert summary["state"] == "finished" and summary["failures_recovered"] == 1, summary
    restores = [e for e in read_jsonl(tmp_path / "split" / "events.jsonl") if e["event"] == "ps_restore"]
    assert [(e["shards"], e["replaced"], e["applied_clocks"]) for e in restores] == [([0, 1], [], {"0": KILL_AT * CLOCKS + 1, "1": KILL_AT * CLOCKS})]
    for i in clean_shards:
        assert_same_arrays(by_id(final["shards"][i]), by_id(clean_shards[i]), f"shard {i}")
    assert summary["final_metrics"]["auc"] == reference["final_metrics"]["auc"]


def test_a_users_parquet_clicks_train_and_a_lost_worker_rereads_only_its_rows(ray_local, tmp_path):
    """Clicks from the user's Parquet files (string ids hashed into each field's table,
    numeric columns, a 0/1 label): a sync run learns them, and one that loses a worker
    mid-step ends bit-identical to it, the replacement reading the lost worker's rows."""
    folder = write_clicks(tmp_path / "clicks", 30_000)

    def conf(name: str) -> PSCTRConfig:
        c = cfg.load_config(PSCTRConfig, overrides=[f"data.path={folder}", "data.label=clicked", "eval_rows=5000", "buckets=2000",
                                                   "workers=2", "shards=2", "batch_size=256", f"clocks_per_step={CLOCKS}",
                                                   "shard_cpus=0.25", "worker_cpus=0.25", "lr=0.1"])
        c.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=STEPS, checkpoint_every_steps=EVERY, progress=False, tensorboard=False)
        return c

    clean, clean_shards, _ = run(conf("parquet"))
    assert clean["state"] == "finished" and clean["final_metrics"]["auc"] > 0.7, clean["final_metrics"]
    assert set(next(iter(clean_shards.values()))["tables"]) == {f"field{f}" for f in range(4)}  # one table per categorical column
    summary, shards, _ = run(conf("parquet_faulted"), kill=WORKERS)
    assert summary["state"] == "finished" and summary["failures_recovered"] >= 1, summary
    for i in clean_shards:
        assert_same_arrays(by_id(shards[i]), by_id(clean_shards[i]), f"shard {i}")
    assert summary["final_metrics"]["auc"] == clean["final_metrics"]["auc"]


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_survive_a_shard_loss_with_every_clock_applied_once(ray_local, tmp_path, mode):
    s = 2
    summary, shards, logs = run(job(tmp_path, mode, mode, staleness=s), kill=SHARDS)
    assert summary["state"] == "finished" and summary["failures_recovered"] >= 1, summary
    assert summary["final_metrics"]["auc"] > 0.72, summary["final_metrics"]
    events = read_jsonl(tmp_path / mode / "events.jsonl")
    assert [e["role"] for e in events if e["event"] == "failure"] == [SHARDS]
    # The promise: the shards hold exactly every (worker, clock) of the run, once; what was
    # applied after the checkpoint was rolled back and applied again, nothing beyond it lost.
    for i, state in shards.items():
        assert state["done"] == {"0": STEPS * CLOCKS, "1": STEPS * CLOCKS} and state["above"] == {"0": [], "1": []}, (i, state["done"])
        assert state["updates"] == 2 * STEPS * CLOCKS, (i, state["updates"])
    if mode == "ssp":
        assert max(clock - slowest for _, clock, slowest in logs) <= s


def test_a_diverging_run_stops_on_the_nan_guard_naming_the_loss(ray_local, tmp_path):
    conf = job(tmp_path, "diverge", "sync", steps=3, lr=1e30)
    with pytest.raises(NonFiniteError, match=r"metric 'loss' is (nan|inf)") as info:
        run(conf)
    assert "Input contains NaN" not in str(info.value) and "last good checkpoint is step 0" in str(info.value)
