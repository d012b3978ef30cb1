"""``raylane tune`` under spot preemptions, against plain Ray Tune running RLlib PPO trials.

On a simulated cluster (``raylane.testing.spotmarket``: an on-demand head of 4 CPUs and two
spot nodes of 2 CPUs), a 6-trial PPO search of CartPole-v1's learning rate, 2 trials at a
time, each trial a fixed budget of env steps (so every trial does the same work):

1. raylane tune, fault-free: the wall-time baseline.
2. raylane tune with a spot node removed without notice every ``--every`` s (replaced 2 s later).
3. Ray Tune running RLlib PPO (new API stack, 2 env runners of 8 envs, the same budget) under the
   same preemptions, with Tune's default failure handling (no trial restarts).

Printed per run: trials completed (reached the budget), trials in error, trials restarted by
Tune and how many of those started from scratch, wall time. Targets: every raylane trial
completes, none restarts from scratch, and the faulted wall time is at most 1.2x the fault-free one.

    python benchmarks/tune.py [--every 60] [--budget 40000] [--skip-rllib]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import ray

SPOT = ("spot-a", "spot-b")


def chaos(market, every: float, seed: int, stop: threading.Event, log: list) -> threading.Thread:
    """Remove a spot node (no notice) every ``every`` s, and add it back 2 s later."""
    rng = random.Random(seed)
    t0 = time.time()

    def run() -> None:
        k = 1
        while not stop.wait(max(0.0, t0 + k * every - time.time())):
            nodes = market.spot_nodes()
            if nodes:
                victim = nodes[rng.randrange(len(nodes))]
                log.append((round(time.time() - t0, 1), victim.name))
                market.remove(victim)
                if stop.wait(2.0):
                    market.add_node("spot", speed=1.0, cpus=2, name=victim.name)
                    return
                market.add_node("spot", speed=1.0, cpus=2, name=victim.name)
            k += 1

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def settle(market) -> None:
    market.refill(dict.fromkeys(SPOT, 1.0), timeout_s=120)


def raylane_search(market, args, runs: Path, name: str, faults: bool) -> dict:
    from raylane.tune.run import Search, tune
    from raylane.tune.space import parse_search

    settle(market)
    s = Search(job="ppo", space=parse_search(["lr=loguniform(3e-4,3e-3)"]),
               overrides=["workers=2", "envs_per_worker=8", "worker_cpus=0.5", f"total_env_steps={args.budget}", "target_return=null",
                          "driver.max_steps=100000", "driver.checkpoint_every_steps=10", "plot=false", "driver.tensorboard=false"],
               trials=6, concurrency=2, runs_dir=str(runs), name=name, seed=args.seed, max_failures=3)
    stop, log = threading.Event(), []
    t0 = time.perf_counter()
    thread = chaos(market, args.every, args.seed, stop, log) if faults else None
    try:
        prep, rows, files = tune(s, say=lambda m: None)
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
    wall = time.perf_counter() - t0
    done = [r for r in rows if r["state"] == "finished"]
    scratch = sum(1 for r in rows for k in r["resumed_from"] if k == 0)
    return {"run": f"raylane tune{' + faults' if faults else ''}", "wall": wall, "completed": len(done), "errors": sum(r["state"] == "error" for r in rows),
            "restarted": sum(1 for r in rows if r["restarts"]), "from_scratch": scratch,
            "recovered_in_trial": sum(r["failures_recovered"] for r in rows), "preemptions": log,
            "best": max((r["best_return_mean"] for r in rows if r["best_return_mean"] is not None), default=None)}


def rllib_search(market, args, runs: Path, faults: bool) -> dict:
    from ray import tune
    from ray.rllib.algorithms.ppo import PPOConfig

    settle(market)
    config = (PPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2, num_envs_per_env_runner=8, num_cpus_per_env_runner=0.5)
              .training(lr=tune.loguniform(3e-4, 3e-3)))
    tuner = tune.Tuner("PPO", param_space=config,
                       tune_config=tune.TuneConfig(num_samples=6, max_concurrent_trials=2, metric="env_runners/episode_return_mean", mode="max"),
                       run_config=tune.RunConfig(name="rllib", storage_path=str(runs), verbose=0,
                                                 stop={"num_env_steps_sampled_lifetime": args.budget}))
    stop, log = threading.Event(), []
    t0 = time.perf_counter()
    thread = chaos(market, args.every, args.seed, stop, log) if faults else None
    try:
        grid = tuner.fit()
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
    wall = time.perf_counter() - t0
    results = list(grid)
    done = [r for r in results if r.error is None and (r.metrics or {}).get("num_env_steps_sampled_lifetime", 0) >= args.budget]
    best = max((float((r.metrics or {}).get("env_runners", {}).get("episode_return_mean", float("nan"))) for r in done), default=None)
    return {"run": f"Ray Tune + RLlib PPO{' + faults' if faults else ''}", "wall": wall, "completed": len(done),
            "errors": sum(r.error is not None for r in results), "restarted": 0, "from_scratch": 0, "recovered_in_trial": None,
            "preemptions": log, "best": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=60.0, help="seconds between preemptions")
    ap.add_argument("--budget", type=int, default=40_000, help="env steps per trial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-rllib", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from raylane.testing.spotmarket import SpotMarket

    runs = Path(tempfile.mkdtemp(prefix="tune-bench-"))
    market = SpotMarket(head_cpus=4)
    results = []
    try:
        ray.init(address=market.address, log_to_driver=False)
        for name in SPOT:
            market.add_node("spot", speed=1.0, cpus=2, name=name)
        results.append(raylane_search(market, args, runs, "fault-free", faults=False))
        results.append(raylane_search(market, args, runs, "faults", faults=True))
        if not args.skip_rllib:
            results.append(rllib_search(market, args, runs, faults=True))
    finally:
        ray.shutdown()
        market.shutdown()
    base = results[0]["wall"]
    print(f"\n6 PPO trials of {args.budget:,} env steps, 2 at a time; a spot node removed every {args.every:g} s (back 2 s later)")
    print(f"{'run':<30}{'completed':>10}{'errors':>8}{'restarted':>10}{'scratch':>8}{'in-trial':>9}{'wall s':>8}{'x fault-free':>13}  preemptions")
    for r in results:
        print(f"{r['run']:<30}{r['completed']:>10}{r['errors']:>8}{r['restarted']:>10}{r['from_scratch']:>8}{str(r['recovered_in_trial']):>9}"
              f"{r['wall']:>8.1f}{r['wall'] / base:>13.2f}  {len(r['preemptions'])}")
    print(f"target: every raylane trial completes, none from scratch, faulted wall <= 1.2x fault-free: "
          f"{results[1]['completed']}/6 completed, {results[1]['from_scratch']} from scratch, {results[1]['wall'] / base:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
