"""Pipeline stages: schedule bubbles against theory, and raylane against torch.distributed.pipelining.

    python benchmarks/pipeline.py                 # both parts
    python benchmarks/pipeline.py --part bubble   # or --part torch; --runs 5 for more repeats

One process tree, one local Ray. Prints:

1. ``bubble``: stages whose every layer takes a fixed time (``StageConfig.timed``: a
   forward of t, a backward of 2t, slept rather than spun so more stages than cores
   measure the schedule and not the OS), for each schedule at p=2 and p=4: the measured
   bubble fraction (``1 - busy / (p x makespan)`` from the stages' own clocks: waiting for
   an input counts as bubble) against the textbook ``(p-1)/(m+p-1)`` and
   ``(p-1)/(v m+p-1)``, the simulated schedule's own bubble, and the overhead per
   operation (driver-measured step time minus the simulated makespan, over the operations
   a stage runs: messaging, dispatch and the driver's round trip), for the linked stages
   over gloo and over Ray actor calls (one driver call per stage per batch) and for the
   driver dispatch (one driver call per operation).
2. ``torch``: a GPT-style model (8 blocks, d_model 256, 4 heads, 64 tokens, batch 16) on 2
   stages with the interleaved schedule (2 chunks per stage), m = 4 and 8, trained for a
   fixed number of steps by torch.distributed.pipelining (gloo, 2 processes,
   ScheduleInterleaved1F1B) and by raylane (2 LinkedStage actors over gloo, the job's
   train_batch),
   one torch thread per stage on both sides, same layer split, same batches, AdamW per
   layer; median steps/s of ``--runs`` runs each (alternating), the ratio, and the
   step-1 loss of both against the unsplit model in this process.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import ray
import torch

from raylane.actors import corpus, gpt
from raylane.actors import pipeline_schedules as S
from raylane.actors.pipeline_split import split_virtual
from raylane.actors.pipeline_stage import LinkedStage, PipelineStage, StageConfig, connect_linked, measured_bubble, pieces_for, train_batch

# ---------------------------------------------------------------- part 1: bubbles

BUBBLE_CASES = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2), ("bfs", 2, 4, 2),
                ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("bfs", 4, 8, 2)]


def bubble_case(name: str, p: int, m: int, v: int, dispatch: str, t_chunk: float, steps: int) -> dict:
    """Step time of a timed pipeline; a chunk's forward takes ``t_chunk / v`` (2 layers of
    half that), its backward twice as long, so every schedule does the same work per stage."""
    model = gpt.GPTConfig(vocab=96, seq_len=8, d_model=8, n_heads=1, n_blocks=2 * p * v - 2)
    t_layer = t_chunk / v / 2
    cfg = StageConfig(model, timed=(t_layer, 2 * t_layer))
    cls = PipelineStage if dispatch == "driver" else LinkedStage
    handles = [cls.options(num_cpus=0.1).remote(cfg) for _ in range(p)]
    sched = S.make(name, p, m, v)
    pieces = pieces_for(sched, split_virtual([1.0] * model.n_layers, [1.0] * p, v))
    ray.get([h.load.remote(pieces[s], sched.virtual_stages - 1) for s, h in enumerate(handles)], timeout=60)
    if dispatch != "driver":
        connect_linked([handles], dispatch, 60)
    x = torch.randint(0, model.vocab, (m, 1, model.seq_len))
    times, bubbles = [], []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        out = train_batch([handles], sched, [(x, x)], dispatch="driver" if dispatch == "driver" else "linked", timeout_s=120)
        if k:  # the first step warms up the actors and the object store
            times.append(time.perf_counter() - t0)
            bubbles.append(measured_bubble(out["steps"]))
    for h in handles:
        ray.kill(h)
    step = statistics.median(times)
    t_f = t_chunk / v
    sim = S.simulate(sched, t_f, 2 * t_f)
    ops = 2 * m * v
    return {"name": name, "p": p, "m": m, "v": v, "dispatch": dispatch, "step_s": step, "measured": statistics.median(bubbles),
            "theory": S.bubble_theory(name, p, m, v), "simulated": sim.bubble, "overhead_ms": 1e3 * (step - sim.makespan) / ops}


def part_bubble(args) -> None:
    print(f"\n== 1. bubble fraction per schedule (chunk forward {args.t_chunk * 1e3:.0f} ms / v, backward twice that; median of {args.steps} steps)")
    print(f"{'schedule':<12}{'p':>3}{'m':>3}{'v':>3}  {'dispatch':<8}{'step s':>8}{'measured':>10}{'theory':>8}{'sim':>8}{'meas/theory':>13}{'ovh/op ms':>11}")
    for name, p, m, v in BUBBLE_CASES:
        for dispatch in ("gloo", "ray", "driver"):
            r = bubble_case(name, p, m, v, dispatch, args.t_chunk, args.steps)
            print(f"{name:<12}{p:>3}{m:>3}{v:>3}  {dispatch:<8}{r['step_s']:>8.3f}{r['measured']:>10.3f}{r['theory']:>8.3f}{r['simulated']:>8.3f}"
                  f"{r['measured'] / r['theory']:>13.3f}{r['overhead_ms']:>11.2f}")


# ---------------------------------------------------------------- part 2: against torch

GPT = gpt.GPTConfig(vocab=corpus.VOCAB, seq_len=64, d_model=256, n_heads=4, n_blocks=8, seed=0)
BATCH, LR = 16, 1e-3


def batches(tokens: np.ndarray, m: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(n):
        x, y = corpus.batch(tokens, m, BATCH // m, GPT.seq_len, seed=0, step=step)
        out.append((torch.from_numpy(x), torch.from_numpy(y)))
    return out


def unsplit_loss(data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model = torch.nn.Sequential(*gpt.build_layers(GPT))
    x, y = data
    with torch.no_grad():
        return float(np.mean([float(gpt.loss_fn(model(x[i]), y[i])) for i in range(x.shape[0])]))


def _torch_rank(rank: int, world: int, port: int, ranges: list[list[int]], m: int, data_path: str, warmup: int, steps: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = torch.load(data_path, weights_only=True)
    nv = len(ranges)
    mine = [j for j in range(nv) if j % world == rank]
    stages, opts = [], []
    for j in mine:
        layers = [gpt.build_layer(GPT, i) for i in ranges[j]]
        opts += [gpt.make_optimizer(layer, LR, 0.0) for layer in layers]
        stages.append(TorchStage(torch.nn.Sequential(*layers), j, nv, torch.device("cpu")))
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=gpt.loss_fn)
    first_loss = None
    t0 = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = data["x"][k], data["y"][k]
        losses: list = []
        if 0 in mine and nv - 1 in mine:
            sched.step(x.reshape(-1, GPT.seq_len), target=y.reshape(-1, GPT.seq_len), losses=losses)
        elif 0 in mine:
            sched.step(x.reshape(-1, GPT.seq_len))
        else:
            sched.step(target=y.reshape(-1, GPT.seq_len), losses=losses)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if k == 0 and losses:
            first_loss = float(torch.stack([torch.as_tensor(v).detach() for v in losses]).mean())
    dist.barrier()
    seconds = time.perf_counter() - t0
    if first_loss is not None:
        with open(out_path, "w") as f:
            f.write(f"{seconds} {first_loss}")
    dist.destroy_process_group()


def run_torch(ranges: list[list[int]], m: int, data: list, warmup: int, steps: int) -> tuple[float, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        data_path, out_path = os.path.join(tmp, "data.pt"), os.path.join(tmp, "out.txt")
        torch.save({"x": torch.stack([x for x, _ in data]), "y": torch.stack([y for _, y in data])}, data_path)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_torch_rank, args=(2, port, ranges, m, data_path, warmup, steps, out_path), nprocs=2, join=True)
        seconds, loss = open(out_path).read().split()
    return steps / float(seconds), float(loss)


def run_raylane(handles, ranges: list[list[int]], m: int, data: list, warmup: int, steps: int) -> tuple[float, float]:
    sched = S.make("interleaved", 2, m, 2)
    pieces = pieces_for(sched, [range(r[0], r[-1] + 1) for r in ranges])
    ray.get([h.load.remote(pieces[s], sched.virtual_stages - 1) for s, h in enumerate(handles)], timeout=120)
    connect_linked([handles], "gloo", 120)
    first_loss = None
    t0 = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            t0 = time.perf_counter()
        out = train_batch([handles], sched, [data[k]], dispatch="linked", timeout_s=300)
        if k == 0:
            first_loss = float(np.mean(out["losses"][0]))
    return steps / (time.perf_counter() - t0), float(first_loss)


def part_torch(args) -> None:
    tokens, _ = corpus.split(corpus.encode(corpus.generate(200_000, 0)), 0.1)
    torch.set_num_threads(1)
    costs = gpt.measure_costs(GPT, BATCH // 4)
    ranges = [list(r) for r in split_virtual(costs, [1.0, 1.0], 2)]
    print(f"\n== 2. GPT ({GPT.n_blocks} blocks, d_model {GPT.d_model}, {gpt.param_count(GPT) / 1e6:.1f}M parameters, batch {BATCH}), "
          f"2 stages x 2 chunks, interleaved 1F1B; {args.torch_steps} timed steps after {args.warmup}, median of {args.runs} runs")
    print(f"layer split (measured costs): {ranges}")
    handles = [LinkedStage.options(num_cpus=1).remote(StageConfig(GPT, lr=LR, threads=1)) for _ in range(2)]
    ray.get([h.__ray_ready__.remote() for h in handles], timeout=120)
    print(f"{'m':>3}  {'torch steps/s':>14}{'raylane steps/s':>17}{'ratio':>8}   step-1 loss: unsplit / torch / raylane")
    for m in args.m:
        data = batches(tokens, m, args.warmup + args.torch_steps)
        ref = unsplit_loss(data[0])
        t_runs, r_runs = [], []
        t_loss = r_loss = float("nan")
        for _ in range(args.runs):
            sps, t_loss = run_torch(ranges, m, data, args.warmup, args.torch_steps)
            t_runs.append(sps)
            sps, r_loss = run_raylane(handles, ranges, m, data, args.warmup, args.torch_steps)
            r_runs.append(sps)
        t_med, r_med = statistics.median(t_runs), statistics.median(r_runs)
        print(f"{m:>3}  {t_med:>14.3f}{r_med:>17.3f}{r_med / t_med:>8.3f}   {ref:.5f} / {t_loss:.5f} / {r_loss:.5f}")
        print(f"     runs: torch {[round(x, 3) for x in t_runs]}  raylane {[round(x, 3) for x in r_runs]}")
    for h in handles:
        ray.kill(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "bubble", "torch"), default="all")
    ap.add_argument("--t-chunk", type=float, default=0.02, help="forward seconds of one stage's layers per micro-batch (split over its chunks)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per bubble case")
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches for the torch comparison")
    ap.add_argument("--torch-steps", type=int, default=10, help="timed steps per run in the torch comparison")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--runs", type=int, default=3, help="runs per side (median reported)")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        if args.part in ("all", "bubble"):
            part_bubble(args)
        if args.part in ("all", "torch"):
            part_torch(args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
