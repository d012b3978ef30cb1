"""GNN sampling and training throughput: raylane's sampler actors against in-process sampling.

    python benchmarks/gnn.py                   # 200,000 nodes, ~4.1M edges, fan-outs [15, 10], batch 1024
    python benchmarks/gnn.py --nodes 50000     # quicker

One process tree, one local Ray. Prints, for the same generated graph:

1. sampled edges per second of the sampling function called in this process, of one
   sampler actor, and of two sampler actors (each with two batches in flight, which the
   actor works on at once: one is stored while the next is sampled), the ratios to
   in-process, and the CPU time per batch of each side;
2. the epoch time of GraphSAGE trained by the trainer actor fed by the sampler pool with
   prefetch (the real ``graphsage`` job through the driver) against the same training loop
   sampling in-process, batch after batch, with one torch thread each (in-process runs
   before and after the pool, against drift), and the time each side spends outside the
   trainer's compute;
3. PyG's ``NeighborLoader`` on the same graph when it can run here (it needs pyg-lib or
   torch-sparse), else a line saying it is unavailable.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import os
import tempfile
import time

import numpy as np
import ray
import torch

from raylane.actors.allocator import keep_freed_memory
from raylane.actors.gnn_sampler import GNNSampler, GNNSamplerActor, SamplerConfig
from raylane.actors.graph import FEATURE_DTYPES, feature_array, sbm_graph, to_shared
from raylane.actors.sage import GNNTrainer, GNNTrainerConfig
from raylane.actors.sampling import epoch_plan
from raylane.api import Driver, job_config
from raylane.jobs.graphsage import GraphSAGEWorkload
from raylane.runlog import read_jsonl


def keys(graph, batch_size: int, n: int) -> list[tuple[int, int, int]]:
    """The first ``n`` batches of the job's epoch order, as (epoch, part, index)."""
    plan = epoch_plan([len(s) for s in graph.train_seeds], batch_size)
    return [(i // len(plan), *plan[i % len(plan)]) for i in range(n)]


def edges_per_s_in_process(sampler: GNNSampler, ks, cpu: list | None = None) -> float:
    t0, c0 = time.perf_counter(), time.process_time()
    edges = sum(int(sampler.batch(*k)["edge_index"].shape[1]) for k in ks)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / len(ks))
    return edges / (time.perf_counter() - t0)


def cpu_per_batch(actor, run, ks, cpu: list) -> float:
    """``run()``'s result; appends the CPU seconds per batch the actor's process spent (all its threads)."""
    c0 = ray.get(actor.info.remote(), timeout=60)["cpu_s"]
    out = run()
    cpu.append((ray.get(actor.info.remote(), timeout=60)["cpu_s"] - c0) / len(ks))
    return out


def edges_per_s_actors(actors, ks) -> float:
    """Sampled edges per second of the sampler ``actors`` working through the batches
    ``ks``, two batches in flight each."""
    inflight, nxt, edges = {}, 0, 0
    for a in actors:
        for _ in range(2):
            if nxt < len(ks):
                inflight[a.batch.remote(*ks[nxt])] = a
                nxt += 1
    t0 = time.perf_counter()
    for _ in range(len(ks)):
        [ref], _ = ray.wait(list(inflight), num_returns=1, timeout=300)
        a = inflight.pop(ref)
        edges += int(ray.get(ref, timeout=60)["edge_index"].shape[1])
        del ref
        if nxt < len(ks):
            inflight[a.batch.remote(*ks[nxt])] = a
            nxt += 1
    return edges / (time.perf_counter() - t0)


def epoch_in_process(graph, fanouts, batch_size: int, hidden: int, seed: int, epochs: int) -> tuple[list[float], list[float], float]:
    """The job's training loop with sampling done inline: the peer the pool has to beat.
    Returns every epoch's time (training + evaluation), the trainer's compute in it
    (training steps + evaluation), and the final test accuracy."""
    torch.set_num_threads(1)
    trainer = GNNTrainer(GNNTrainerConfig(in_dim=int(graph.x.shape[1]), num_classes=graph.num_classes, hidden=hidden, layers=len(fanouts), seed=seed), graph)
    sampler = GNNSampler(SamplerConfig(tuple(fanouts), batch_size, seed), graph)
    plan = epoch_plan([len(s) for s in graph.train_seeds], batch_size)
    times, busy = [], []
    for epoch in range(epochs):
        t0, b = time.perf_counter(), 0.0
        for part, index in plan:
            b += trainer.train(sampler.batch(epoch, part, index))["train_s"]
        ev = trainer.evaluate()
        times.append(time.perf_counter() - t0)
        busy.append(b + ev["eval_s"])
    return times, busy, ev["test_acc"]


def epoch_with_pool(graph, fanouts, batch_size: int, hidden: int, seed: int, samplers: int, prefetch: int, epochs: int) -> tuple[list[float], list[float], float]:
    """The ``graphsage`` job through the driver; per epoch its time and the trainer's compute, and the final test accuracy."""
    runs = tempfile.mkdtemp(prefix="gnn-bench-")
    conf = job_config("graphsage", overrides=[
        f"fanouts={list(fanouts)}", f"batch_size={batch_size}", f"hidden={hidden}", f"epochs={epochs}", f"samplers={samplers}",
        "sampler_cpus=1", "trainer_cpus=1", f"prefetch={prefetch}", "batches_per_step=16", f"seed={seed}",
        "driver.progress=false", "driver.tensorboard=false", "driver.checkpoint_every_steps=0", f"driver.runs_dir={runs}", "driver.run_name=bench",
    ])
    workload = GraphSAGEWorkload(conf, graph=graph)
    summary = Driver(workload, conf.driver).run()
    rows = read_jsonl(os.path.join(runs, "bench", "metrics.jsonl"))
    times, busy = [0.0] * epochs, [0.0] * epochs
    for r in rows:  # a step never crosses an epoch end; its epoch is the one it ends in or inside
        e = min(epochs - 1, int(r["epoch"] - 1e-9))
        times[e] += r["step_s"]
        busy[e] += r["train_s"] + r.get("eval_s", 0.0)
    return times, busy, summary["final_metrics"]["test_acc"]


def pyg_loader(data, fanouts, batch_size: int, batches: int) -> str:
    try:
        from torch_geometric.loader import NeighborLoader

        loader = NeighborLoader(data, num_neighbors=list(fanouts), batch_size=batch_size, input_nodes=data.train_mask, shuffle=True)
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        edges = sum(int(next(it).edge_index.shape[1]) for _ in range(batches))
        return f"{edges / (time.perf_counter() - t0):,.0f} edges/s"
    except ImportError as exc:
        return f"unavailable here ({exc})"


def sampling_rates(args, data, graph, graph_ref, sc) -> None:
    batch = GNNSampler(sc, graph).batch(0, 0, 0)
    batch_bytes = sum(v.nbytes for v in batch.values() if hasattr(v, "nbytes"))
    # Plasma keeps a freed batch until it needs the space, so a fresh store hands every new
    # batch untouched shared-memory pages (a page fault per 4 KiB on first write); a job
    # that has run for a while recycles pages its processes have already mapped. One pass
    # through the store first, then the steady state; both are printed.
    warmup = math.ceil(args.store_mib * 2**20 / batch_bytes) + 10
    ks = keys(graph, sc.batch_size, warmup + args.batches + 7)
    local = GNNSampler(sc, graph)
    edges_per_s_in_process(local, ks[: args.batches // 2])  # this process's pages of the graph
    one = [GNNSamplerActor.options(num_cpus=1).remote(sc, graph_ref)]
    two = one + [GNNSamplerActor.options(num_cpus=1).remote(sc, graph_ref)]
    ray.get([a.info.remote() for a in two], timeout=300)  # started, graph mapped
    cold = edges_per_s_actors(one, ks[:warmup])
    edges_per_s_actors(two[1:], ks[:warmup])
    # Rounds alternate the batches and the order of the sides, so a slow spell of this shared machine hits both; the
    # ratios are medians over the rounds.
    rows, cpu_in, cpu_one = [], [], []
    for r in range(args.rounds):
        part = ks[warmup + (r % 2) * 7 :][: args.batches]
        run_in = lambda: edges_per_s_in_process(local, part, cpu_in)  # noqa: E731
        run_one = lambda: cpu_per_batch(one[0], lambda: edges_per_s_actors(one, part), part, cpu_one)  # noqa: E731
        if r % 2:  # odd rounds run the sides in the other order
            two_r, one_r, inproc_r = edges_per_s_actors(two, part), run_one(), run_in()
        else:
            inproc_r, one_r, two_r = run_in(), run_one(), edges_per_s_actors(two, part)
        rows.append((inproc_r, one_r, two_r))
    for a in two:
        ray.kill(a)
    inproc = statistics.median(r[0] for r in rows)
    r1 = statistics.median(r[1] / r[0] for r in rows)
    r2 = statistics.median(r[2] / r[0] for r in rows)
    print(f"\n{graph.x.dtype} features: sampled edges per second (sampling + feature gather; actors: 2 batches in flight each; "
          f"{batch_bytes / 2**20:.1f} MiB a batch, {args.store_mib} MiB object store; median of {args.rounds} rounds of {args.batches} batches)")
    print(f"  in-process function   {inproc:>12,.0f}")
    print(f"  1 sampler actor       {r1 * inproc:>12,.0f}   {r1:.2f}x in-process (target >= 0.9)   rounds: " + " ".join(f"{r[1] / r[0]:.2f}" for r in rows))
    print(f"    its first pass through the fresh store ({warmup} batches)   {cold:,.0f}   {cold / inproc:.2f}x")
    print(f"    CPU per batch: in-process {statistics.median(cpu_in) * 1e3:.1f} ms, 1 sampler actor {statistics.median(cpu_one) * 1e3:.1f} ms "
          "(its process, all threads: sampling + storing the batch)")
    print(f"  2 sampler actors      {r2 * inproc:>12,.0f}   {r2:.2f}x in-process   rounds: " + " ".join(f"{r[2] / r[0]:.2f}" for r in rows))
    if graph.x.dtype == np.float32:
        print(f"  PyG NeighborLoader    {pyg_loader(data, args.fanouts, args.batch_size, args.batches)}")


def epoch_times(args, graph) -> None:
    # In-process before and after the pool: this shared machine's speed drifts by 10-20%
    # over minutes, and a drift that is steady over the three runs cancels in the mean of
    # the two in-process runs.
    t_a, b_a, acc_in = epoch_in_process(graph, args.fanouts, args.batch_size, args.hidden, args.seed, args.epochs)
    t_pool, b_pool, acc_pool = epoch_with_pool(graph, args.fanouts, args.batch_size, args.hidden, args.seed, args.samplers, args.prefetch, args.epochs)
    t_b, b_b, _ = epoch_in_process(graph, args.fanouts, args.batch_size, args.hidden, args.seed, args.epochs)
    print(f"\nepoch time (GraphSAGE training + full-graph evaluation, one torch thread for training; {args.epochs} epochs a run, the first is warm-up)")
    fmt = lambda ts: " ".join(f"{t:6.1f}" for t in ts)  # noqa: E731
    print(f"  in-process sampling, batch after batch (before)  {fmt(t_a)} s   test acc {acc_in:.3f}")
    print(f"  trainer actor fed by {args.samplers} samplers, prefetch {args.prefetch}    {fmt(t_pool)} s   test acc {acc_pool:.3f}")
    print(f"  in-process sampling, batch after batch (after)   {fmt(t_b)} s")
    steady = lambda ts: sum(ts[1:]) / (len(ts) - 1)  # noqa: E731
    steady_in, steady_pool = (steady(t_a) + steady(t_b)) / 2, steady(t_pool)
    print(f"  steady-state epoch: pool {steady_pool:.1f} s / in-process {steady_in:.1f} s = {steady_pool / steady_in:.2f} (target <= 1.0)")
    # What each side spends outside the trainer's compute (sampling in-process; waiting for
    # a batch or for the driver with the pool) is the part the pool is there to remove, and
    # it drifts far less with the machine's speed than the compute does.
    out = lambda ts, bs: steady([t - b for t, b in zip(ts, bs)])  # noqa: E731
    out_in, out_pool = (out(t_a, b_a) + out(t_b, b_b)) / 2, out(t_pool, b_pool)
    print(f"  per epoch outside the trainer's compute: in-process (sampling) {out_in:.1f} s, pool (trainer waiting) {out_pool:.1f} s; "
          f"trainer compute: in-process {steady(b_a):.1f} s before, {steady(b_b):.1f} s after, in the actor {steady(b_pool):.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--degree", type=float, default=20.6, help="mean degree (both directions stored)")
    ap.add_argument("--fanouts", type=int, nargs="+", default=[15, 10])
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=60, help="batches per sampling-rate measurement")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the sampling-rate measurement")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--samplers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="epochs per side (>= 2; the first is warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-mib", type=int, default=1024, help="object store size of the benchmark's Ray (MiB)")
    ap.add_argument("--feature-dtypes", nargs="+", default=["float32", "float16"], choices=FEATURE_DTYPES, help="feature precisions the sampling rates are measured with")
    ap.add_argument("--only", choices=["sampling", "epoch"], default=None, help="run one half of the benchmark")
    args = ap.parse_args()

    # The sampler actors keep freed batch memory in their process (no page faults on the
    # next batch); the in-process side gets the same allocator setting, for a like-for-like
    # comparison.
    kept = keep_freed_memory()
    print(f"allocator: freed memory kept in-process and in the sampler actors: {kept}")
    t0 = time.perf_counter()
    data = sbm_graph(args.nodes, avg_degree=args.degree, seed=args.seed)
    t1 = time.perf_counter()
    graph = to_shared(data, args.samplers, seed=args.seed)
    t2 = time.perf_counter()
    print(f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {sum(len(s) for s in graph.train_seeds):,} training seeds; "
          f"generated in {t1 - t0:.1f} s, METIS into {graph.num_parts} parts + CSR in {t2 - t1:.1f} s")
    sc = SamplerConfig(tuple(args.fanouts), args.batch_size, args.seed)
    b = GNNSampler(sc, graph).batch(0, 0, 0)
    print(f"batch: {b['batch_size']} seeds, {len(b['n_id']):,} nodes, {b['edge_index'].shape[1]:,} edges, {b['x'].nbytes / 2**20:.1f} MiB of features")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=args.store_mib * 2**20)
    try:
        if args.only != "epoch":
            for dtype in args.feature_dtypes:
                g = dataclasses.replace(graph, x=feature_array(graph.x, dtype))
                graph_ref = ray.put(g)
                sampling_rates(args, data, g, graph_ref, sc)
                del graph_ref
        if args.only != "sampling":
            epoch_times(args, graph)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
