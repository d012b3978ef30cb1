"""Checkpoints of a parameter server's state: the actors writing their own parts from a
snapshot (raylane) against the state pulled into the driver and written there (what
raylane did before, and what a workload does that returns its actors' states), and a
lost shard restored from its keeper's memory against from the store.

    python benchmarks/checkpoint_parts.py                 # 0.1, 0.5 and 1 GB of embedding rows
    python benchmarks/checkpoint_parts.py --gb 0.1 --repeats 3

One process tree: a simulated two-node cluster (``ray.cluster_utils.Cluster``; the keeper
sits on the other node), two ``ParamShard`` actors holding half the rows each (Adagrad:
values and one slot), a checkpoint folder in a temporary directory. For each size it
prints, medians over ``--repeats``:

- the step's stall: the snapshot (raylane) against the pull-and-write (through the driver);
- the time until the checkpoint is whole (raylane: snapshot, parts written in parallel,
  manifest) against the same through the driver;
- the driver's resident memory growth during each (sampled every 10 ms);
- a shard restored from its keeper's copy against from the store (the replacement reads
  its part and checks its sha256).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import ray
from ray.cluster_utils import Cluster

from raylane.actors.param_shard import ParamShard, ShardConfig
from raylane.actors.ps_layout import row_shard
from raylane.checkpoint import CheckpointStore, part_dir
from raylane.checkpoint_format import PartRef
from raylane.checkpoint_parts import snapshot
from raylane.replicas import ReplicaKeeper

DIM, TABLE = 32, "emb_0"
ROW_BYTES = DIM * 4 * 2 + 8 + 8  # values and one Adagrad slot, float32; id and step count


class PeakRSS:
    """The driver's resident memory above where it was when the block began."""

    def __enter__(self):
        self.proc, self.base, self.peak, self.stop = psutil.Process(), psutil.Process().memory_info().rss, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss - self.base)


def fill(shards: list, rows: int) -> None:
    """Create ``rows`` embedding rows over the shards (pulls create rows on first touch)."""
    ids = np.arange(rows, dtype=np.int64)
    owner = row_shard(TABLE, ids, len(shards))
    for s, actor in enumerate(shards):
        mine = ids[owner == s]
        for chunk in np.array_split(mine, max(1, len(mine) // 200_000)):
            ray.get(actor.pull.remote(0, 0, {TABLE: chunk}), timeout=600)


def through_driver(shards: list, store: CheckpointStore, step: int) -> tuple[float, float]:
    """(stall, whole): every state pulled into the driver, then written by it."""
    t0 = time.perf_counter()
    states = ray.get([s.export_state.remote() for s in shards], timeout=600)
    store.save(step, {"shards": {str(i): st for i, st in enumerate(states)}})
    t = time.perf_counter() - t0
    return t, t


def as_parts(shards: list, store: CheckpointStore, step: int) -> tuple[float, float]:
    """(stall, whole): snapshots, then the parts written by the shards, then the manifest."""
    t0 = time.perf_counter()
    parts = snapshot({str(i): s for i, s in enumerate(shards)}, timeout_s=600)
    stall = time.perf_counter() - t0
    store.clear(step)
    names = {k: f"shards.{k}" for k in parts}
    for k, p in parts.items():
        p.handle.persist_part.remote(store.uri, part_dir(store.root, step, names[k]), p.token)
    files = ray.get([p.handle.part_written.remote(p.token, 600.0) for p in parts.values()], timeout=600)
    store.save(step, {"shards": {k: PartRef(names[k]) for k in parts}}, parts={names[k]: f for k, f in zip(parts, files)})
    return stall, time.perf_counter() - t0


def restores(shard, store: CheckpointStore, step: int, keeper) -> tuple[float, float]:
    """(from the keeper's memory, from the store) for one shard: its snapshot handed to a
    keeper on the other node, then loaded back either way."""
    part = snapshot({"0": shard}, timeout_s=600)["0"]
    ray.get(keeper.hold.remote("s", step, shard.peek_snapshot.remote(part.token)), timeout=600)
    t0 = time.perf_counter()
    ray.get(shard.load_part.remote(keeper.replica.remote("s", step)), timeout=600)
    memory = time.perf_counter() - t0
    _, state = store.load(step)
    t0 = time.perf_counter()
    ray.get(shard.load_part.remote(state["shards"]["0"]), timeout=600)
    return memory, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="embedding state sizes (values + optimizer slot), GB")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 4 << 30})
    other = cluster.add_node(num_cpus=1, object_store_memory=3 << 30)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    head_id = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    keeper = ReplicaKeeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=other.node_id, soft=False)).remote()
    print(f"{'state':>8} | {'stall: parts':>12} {'driver':>8} {'ratio':>6} | {'whole: parts':>12} {'driver':>8} {'ratio':>6} | "
          f"{'driver RSS: parts':>17} {'driver':>8} | {'restore: memory':>15} {'store':>7} {'ratio':>6}")
    try:
        for gb in args.gb:
            rows = int(gb * 1e9 / ROW_BYTES)
            shards = [ParamShard.options(num_cpus=0.5, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head_id, soft=False)).remote()
                      for _ in range(2)]
            ray.get([s.setup.remote(ShardConfig(i, 2, 1, {}, {TABLE: DIM}, "async", 0, "adagrad", 0.05, 0.05, 0, 600.0)) for i, s in enumerate(shards)], timeout=120)
            fill(shards, rows)
            res: dict[str, list[float]] = {k: [] for k in ("p_stall", "p_whole", "d_stall", "d_whole", "p_rss", "d_rss", "mem", "store")}
            with tempfile.TemporaryDirectory() as tmp:
                store = CheckpointStore(str(Path(tmp) / "ckpt"), keep=2)
                for r in range(args.repeats):
                    with PeakRSS() as m:
                        stall, whole = as_parts(shards, store, 2 * r + 1)
                    res["p_stall"].append(stall), res["p_whole"].append(whole), res["p_rss"].append(m.peak)
                    with PeakRSS() as m:
                        stall, whole = through_driver(shards, store, 2 * r + 2)
                    res["d_stall"].append(stall), res["d_whole"].append(whole), res["d_rss"].append(m.peak)
                    mem, st = restores(shards[0], store, 2 * r + 1, keeper)
                    res["mem"].append(mem), res["store"].append(st)
            med = {k: statistics.median(v) for k, v in res.items()}
            print(f"{gb:>6.1f}GB | {med['p_stall']:>11.3f}s {med['d_stall']:>7.3f}s {med['p_stall'] / med['d_stall']:>6.2f} | "
                  f"{med['p_whole']:>11.3f}s {med['d_whole']:>7.3f}s {med['p_whole'] / med['d_whole']:>6.2f} | "
                  f"{med['p_rss'] / 2**20:>15.0f}MB {med['d_rss'] / 2**20:>6.0f}MB | {med['mem']:>14.3f}s {med['store']:>6.3f}s {med['mem'] / med['store']:>6.2f}",
                  flush=True)
            for s in shards:
                ray.kill(s)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"(pid {os.getpid()}; stall = the step waits; whole = until the checkpoint is on disk with its manifest; "
          "restore: one shard's state into a live shard)")


if __name__ == "__main__":
    main()
