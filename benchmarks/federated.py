"""Federated rounds under heterogeneity: FedProx against FedAvg, and raylane against Flower's
simulation engine on the same work.

The problem (both sides): scikit-learn's digits over 20 clients with label skew
(Dirichlet alpha 0.1), 5 clients a round, half the clients stragglers that get through a
quarter of their steps (``slowdown`` 4: partial work), 10 % of the sampled clients
vanishing each round, the same MLP from the same initial weights, 2 local epochs of SGD.
FedProx (mu 0.01) keeps the stragglers' partial work; FedAvg drops it.

Flower (``flwr[simulation]``, its FedAvg and FedProx strategies) pins an older Ray, so it
runs in a virtual environment of its own, as a subprocess, one side after the other and
interleaved over repeats. Build that environment once with::

    python benchmarks/federated.py --setup-flower      # .venv-flower beside the project

and run::

    python benchmarks/federated.py [--rounds 100] [--target 0.7] [--repeats 2] [--no-flower]

Printed per side and algorithm: rounds to the target accuracy, the median wall time of a
round (local training, gathering, aggregation and evaluation), start-up, and the final
accuracy (repeat r uses seed + r on both sides); then FedProx's rounds against FedAvg's and raylane's round time against
Flower's. Both sides give the clients the same CPUs (``--actors`` x ``--client-cpus``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FLOWER_VENV = ROOT / ".venv-flower"
FLOWER_SETUP = [
    [sys.executable, "-m", "venv", str(FLOWER_VENV)],
    [str(FLOWER_VENV / "bin" / "pip"), "install", "torch==2.13.0"],
    [str(FLOWER_VENV / "bin" / "pip"), "install", "flwr[simulation]==1.42.0", "scikit-learn"],
]


def overrides(args, algorithm: str) -> list[str]:
    return [f"algorithm={algorithm}", f"clients={args.clients}", f"clients_per_round={args.per_round}", f"alpha={args.alpha}",
            f"stragglers={args.stragglers}", f"slowdown={args.slowdown}", f"dropout={args.dropout}", f"target_accuracy={args.target}",
            f"actors={args.actors}", f"max_actors={args.actors}", f"client_cpus={args.client_cpus}", f"seed={args.seed}",
            f"driver.max_steps={args.rounds}", "driver.checkpoint_every_steps=1000", "driver.progress=false", "driver.tensorboard=false"]


def write_spec(conf, folder: Path) -> Path:
    """The same problem for Flower's side: rows, partitions, initial weights, budgets, dropouts."""
    from raylane.actors.fed_client import make_model
    from raylane.actors.fed_data import load
    from raylane.actors.fed_math import drops_out, is_straggler

    data = load(conf.source())
    model = make_model(data.x.shape[1], conf.hidden, data.classes, conf.seed)
    offsets = np.cumsum([0] + [len(p) for p in data.parts])
    arrays = {"train_x": data.x, "train_y": data.y, "test_x": data.test_x, "test_y": data.test_y,
              "part_rows": np.concatenate(data.parts).astype(np.int64), "part_offsets": offsets.astype(np.int64)}
    arrays.update({f"w_{k}": v.detach().numpy() for k, v in model.state_dict().items()})
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "data.npz", **arrays)
    planned = [conf.local_epochs * -(-len(p) // conf.batch_size) for p in data.parts]
    spec = {
        "algorithm": conf.algorithm, "mu": conf.proximal, "clients": len(data.parts), "clients_per_round": conf.clients_per_round,
        "rounds": conf.driver.max_steps, "local_epochs": conf.local_epochs, "batch_size": conf.batch_size, "lr": conf.lr,
        "hidden": conf.hidden, "seed": conf.seed, "target_accuracy": conf.target_accuracy, "actors": conf.actors, "client_cpus": conf.client_cpus,
        "budgets": [max(1, int(n / conf.slowdown)) if is_straggler(conf.seed, k, conf.stragglers) else None for k, n in enumerate(planned)],
        "dropouts": [[k for k in range(len(data.parts)) if drops_out(conf.seed, r, k, conf.dropout)] for r in range(conf.driver.max_steps)],
    }
    (folder / "config.json").write_text(json.dumps(spec))
    return folder


def raylane_side(args, algorithm: str, runs: Path) -> dict:
    import ray

    from raylane.api import run
    from raylane.runlog import read_jsonl

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=max(1, round(args.actors * args.client_cpus)), include_dashboard=False, log_to_driver=False)
    try:
        name = f"{algorithm}-{time.monotonic_ns()}"
        summary = run("federated", overrides=overrides(args, algorithm) + [f"driver.runs_dir={runs}"], run_name=name)
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    rows = read_jsonl(runs / name / "metrics.jsonl")
    accuracy = [r["accuracy"] for r in rows]
    round_s = [r["round_s"] for r in rows]
    return {"accuracy": accuracy, "round_s": round_s, "wall_s": wall, "startup_s": wall - sum(round_s),
            "rounds_to_target": _first(accuracy, args.target), "state": summary["state"]}


def flower_side(args, algorithm: str, spec_root: Path) -> dict:
    from raylane.api import job_config

    conf = job_config("federated", overrides=overrides(args, algorithm))
    spec = write_spec(conf, spec_root / algorithm)
    t0 = time.perf_counter()
    out = subprocess.run([str(args.flower_python), str(ROOT / "benchmarks" / "flower_side.py"), str(spec)],
                         capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FLOWER_RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"Flower's side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(line.split(" ", 1)[1])
    result["wall_s"] = wall  # the process's whole life, as the raylane side's includes starting Ray
    result["startup_s"] = wall - sum(result["round_s"])
    if result.get("rounds_to_target") is None:
        result["rounds_to_target"] = _first(result["accuracy"], args.target)
    return result


def _first(accuracy: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(accuracy) if a >= target), None)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(results: dict[tuple[str, str], list[dict]], target: float) -> None:
    print(f"\n{'side':8} {'algorithm':9} {'rounds to ' + str(target):>15} {'round s (median)':>17} {'start-up s':>11} {'final acc':>10}  runs")
    summary = {}
    for (side, algorithm), runs in sorted(results.items()):
        to_target = [r["rounds_to_target"] for r in runs]
        round_s = _median([s for r in runs for s in r["round_s"]])
        summary[side, algorithm] = (_median(to_target), round_s)
        shown = "/".join("-" if t is None else str(t) for t in to_target)
        print(f"{side:8} {algorithm:9} {shown:>15} {round_s:17.3f} {_median([r['startup_s'] for r in runs]):11.1f} "
              f"{_median([r['accuracy'][-1] for r in runs]):10.3f}  {len(runs)}")
    for side in sorted({s for s, _ in summary}):
        prox, avg = summary.get((side, "fedprox")), summary.get((side, "fedavg"))
        if prox and avg:
            print(f"{side}: FedProx reaches {target} in {prox[0]} rounds (median), FedAvg dropping stragglers in {avg[0]}")
    for algorithm in ("fedprox", "fedavg"):
        ours, theirs = summary.get(("raylane", algorithm)), summary.get(("flower", algorithm))
        if ours and theirs:
            print(f"{algorithm}: raylane round time / Flower's = {ours[1] / theirs[1]:.2f} ({ours[1]:.3f} s vs {theirs[1]:.3f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--stragglers", type=float, default=0.5)
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--client-cpus", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--flower-python", type=Path, default=FLOWER_VENV / "bin" / "python")
    ap.add_argument("--no-flower", action="store_true", help="raylane's side only")
    ap.add_argument("--setup-flower", action="store_true", help="build Flower's virtual environment and exit")
    args = ap.parse_args()
    if args.setup_flower:
        for cmd in FLOWER_SETUP:
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        return
    flower = not args.no_flower
    if flower and not args.flower_python.exists():
        sys.exit(f"no Flower environment at {args.flower_python}: build it with `python benchmarks/federated.py --setup-flower`, "
                 "or give --flower-python, or run with --no-flower")
    results: dict[tuple[str, str], list[dict]] = {}
    seed0 = args.seed
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            args.seed = seed0 + rep  # each repeat another split, stragglers and dropouts; both sides the same
            for algorithm in ("fedprox", "fedavg"):
                sides = ("raylane", "flower") if rep % 2 == 0 else ("flower", "raylane")
                for side in sides:
                    if side == "flower" and not flower:
                        continue
                    r = raylane_side(args, algorithm, Path(tmp) / "runs") if side == "raylane" else flower_side(args, algorithm, Path(tmp) / f"spec{rep}")
                    results.setdefault((side, algorithm), []).append(r)
                    print(f"repeat {rep + 1} {side:8} {algorithm:8} rounds to target {r['rounds_to_target']}, "
                          f"median round {_median(r['round_s']):.3f} s, start-up {r['startup_s']:.1f} s, final accuracy {r['accuracy'][-1]:.3f}", flush=True)
    report(results, args.target)


if __name__ == "__main__":
    main()
