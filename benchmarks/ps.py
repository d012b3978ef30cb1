"""Parameter shards: round-trip cost, update throughput by shard count, and time to a target AUC by consistency mode.

    python benchmarks/ps.py                  # all three
    python benchmarks/ps.py --part roundtrip # or throughput, or auc

One process tree, one local Ray. Prints:

1. ``roundtrip``: a push then a pull of a fixed payload (``--dense`` float32 gradients and
   ``--rows`` embedding rows of ``--dim``) to one shard, against a raw Ray actor with the
   same two calls that only stores and returns the payload (no optimizer, no clocks):
   median milliseconds of each and the ratio (target <= 1.25), with SGD on the shard
   (the transport and bookkeeping) and with Adagrad (plus the optimizer's arithmetic).
2. ``throughput``: pushes per second applied by 1, 2 and 4 shards when 2 driver threads
   push the same total payload, split over the shards as the workers split it.
3. ``auc``: the ``ps_ctr`` job with 2 workers and 2 shards in sync, async and SSP(2) mode
   until the held-out AUC reaches ``--target-auc``: wall time, clocks, and the pulls'
   mean wait per step (what the mode costs in waiting).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import numpy as np
import ray

from raylane.actors.param_shard import ParamShard, ShardConfig
from raylane.actors.ps_layout import dense_slices, row_shard
from raylane.api import Driver, job_config, workload


@ray.remote
class RawStore:
    """The peer: the same calls, the payload only stored and returned."""

    def __init__(self) -> None:
        self.dense: dict = {}
        self.rows: dict = {}

    def push(self, worker, clock, dense, sparse):
        self.dense, self.rows = dense, sparse
        return True

    def pull(self, worker, clock, ids):
        return self.dense, {t: self.rows[t][1] for t in ids}


def payload(dense_n: int, rows: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    dense = {"w": rng.standard_normal(dense_n).astype(np.float32)}
    ids = np.arange(rows, dtype=np.int64) * 7 + 3
    sparse = {"t": (ids, rng.standard_normal((rows, dim)).astype(np.float32))}
    return dense, sparse, {"t": ids}


def shard_actor(dense_n: int, dim: int, optimizer: str, index: int = 0, shards: int = 1, workers: int = 1):
    h = ParamShard.options(num_cpus=0.5).remote()
    sl = dense_slices({"w": dense_n}, shards)[index]
    ray.get(h.setup.remote(ShardConfig(index, shards, workers, sl, {"t": dim}, "async", 0, optimizer, 0.01)), timeout=60)
    ray.get(h.init_dense.remote({"w": np.zeros(sl["w"][1] - sl["w"][0], np.float32)}), timeout=60)
    return h


def roundtrip_ms(h, dense, sparse, ids, n: int) -> float:
    times = []
    for clock in range(n + 3):
        t0 = time.perf_counter()
        ray.get(h.push.remote(0, clock, dense, sparse), timeout=60)
        ray.get(h.pull.remote(0, clock + 1, ids), timeout=60)
        if clock >= 3:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def part_roundtrip(args) -> None:
    dense, sparse, ids = payload(args.dense, args.rows, args.dim)
    mb = (dense["w"].nbytes + sparse["t"][1].nbytes + sparse["t"][0].nbytes) / 2**20
    print(f"\n== 1. push + pull round trip, {args.dense:,} dense floats + {args.rows} rows x {args.dim} ({mb:.2f} MiB each way); median of {args.n}")
    raw = RawStore.options(num_cpus=0.5).remote()
    base = roundtrip_ms(raw, dense, sparse, ids, args.n)
    print(f"  raw Ray actor (store and return)   {base:8.2f} ms")
    for opt in ("sgd", "adagrad"):
        h = shard_actor(args.dense, args.dim, opt)
        ms = roundtrip_ms(h, dense, sparse, ids, args.n)
        print(f"  raylane shard, {opt:<8}            {ms:8.2f} ms   {ms / base:.2f}x raw (target <= 1.25)")
        ray.kill(h)
    ray.kill(raw)


def part_throughput(args) -> None:
    dense, sparse, ids = payload(args.dense, args.rows, args.dim)
    print(f"\n== 2. pushes applied per second, 2 pushing threads, the same total payload split over the shards ({args.seconds:g} s each)")
    for shards in (1, 2, 4):
        hs = [shard_actor(args.dense, args.dim, "adagrad", i, shards, workers=2) for i in range(shards)]
        sl = dense_slices({"w": args.dense}, shards)
        owner = row_shard("t", sparse["t"][0], shards)
        parts = []
        for i in range(shards):
            a, b = sl[i]["w"]
            m = owner == i
            parts.append(({"w": dense["w"][a:b]}, {"t": (sparse["t"][0][m], sparse["t"][1][m])}))
        refs_parts = [(ray.put(d), ray.put(s)) for d, s in parts]
        count = [0, 0]
        stop = time.monotonic() + args.seconds

        def pusher(w: int) -> None:
            clock = 0
            while time.monotonic() < stop:
                ray.get([h.push.remote(w, clock, d, s) for h, (d, s) in zip(hs, refs_parts)], timeout=60)
                clock += 1
            count[w] = clock

        threads = [threading.Thread(target=pusher, args=(w,)) for w in range(2)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = sum(count) / (time.monotonic() - t0)
        print(f"  {shards} shard(s)   {rate:8.1f} full updates/s")
        for h in hs:
            ray.kill(h)


def part_auc(args) -> None:
    print(f"\n== 3. time to held-out AUC {args.target_auc} (ps_ctr, 2 workers, 2 shards, adagrad)")
    for mode in ("sync", "async", "ssp"):
        runs = tempfile.mkdtemp(prefix="ps-bench-")
        conf = job_config("ps_ctr", overrides=[
            f"mode={mode}", "staleness=2", f"target_auc={args.target_auc}", "clocks_per_step=10", "driver.max_steps=200",
            "driver.progress=false", "driver.tensorboard=false", "driver.checkpoint_every_steps=0", f"driver.runs_dir={runs}", f"driver.run_name={mode}",
        ])
        t0 = time.perf_counter()
        summary = Driver(workload("ps_ctr", conf), conf.driver).run()
        wall = time.perf_counter() - t0
        m = summary["final_metrics"]
        print(f"  {mode + ('(2)' if mode == 'ssp' else ''):<8} {wall:7.1f} s   {m['clock']:5d} clocks   AUC {m['auc']:.4f}   pull wait {m['pull_wait_s']:.3f} s/step   {summary['state']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "roundtrip", "throughput", "auc"), default="all")
    ap.add_argument("--dense", type=int, default=100_000, help="dense gradient floats per push")
    ap.add_argument("--rows", type=int, default=1024, help="embedding rows per push")
    ap.add_argument("--dim", type=int, default=16, help="embedding row width")
    ap.add_argument("--n", type=int, default=50, help="round trips per measurement")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput measurement")
    ap.add_argument("--target-auc", type=float, default=0.82)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        if args.part in ("all", "roundtrip"):
            part_roundtrip(args)
        if args.part in ("all", "throughput"):
            part_throughput(args)
        if args.part in ("all", "auc"):
            part_auc(args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
