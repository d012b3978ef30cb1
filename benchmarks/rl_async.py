"""The asynchronous part of the RL benchmark (``python benchmarks/rl.py --async``).

1. Time and env steps to a CartPole-v1 mean return of 475 on one local Ray, with the same
   runners (2) and envs per runner (8): raylane ``impala`` (APPO loss, its defaults),
   raylane ``ppo`` and RLlib APPO (its tuned CartPole example: circular buffer of 2
   iterations per batch, vf_loss_coeff 0.05, no entropy, shared value layers).
   Targets: raylane async at most 0.5x RLlib APPO's wall time.
2. On a simulated cluster (``raylane.testing.spotmarket``: an on-demand head and spot
   nodes of speed 1 and 2, plus one of speed 0.25 when the slow node is on), with env
   steps emulated at ``--emulate`` s / speed: learner updates per second (impala) and
   iterations per second (ppo) without and with the 4x-slow node, and time to 475 with it.
   Targets: impala keeps >= 0.9x its own no-slow-node rate and solves sooner than ppo.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import ray

TARGET = 475.0


def raylane_solve(job: str, cap_s: float, *overrides: str) -> tuple[float, int, float, list[dict]]:
    from raylane.api import Driver, job_config, workload
    from raylane.runlog import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        conf = job_config(job, overrides=["workers=2", "envs_per_worker=8", "total_env_steps=5000000", "plot=false",
                                                    f"driver.runs_dir={tmp}", "driver.run_name=bench", f"driver.max_wall_s={cap_s}",
                                                    "driver.progress=false", "driver.tensorboard=false", *overrides])
        t0 = time.perf_counter()
        summary = Driver(workload(job, conf), conf.driver).run()
        wall = time.perf_counter() - t0
        rows = read_jsonl(f"{tmp}/bench/metrics.jsonl")
    m = summary["final_metrics"]
    return wall, int(m["env_steps"]), float(m["return_mean"]), rows


def rllib_appo_solve(cap_s: float) -> tuple[float, int, float]:
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (
        APPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=8)
        .training(circular_buffer_iterations_per_batch=2, vf_loss_coeff=0.05, entropy_coeff=0.0)
        .rl_module(model_config=DefaultModelConfig(vf_share_layers=True))
    )
    t0 = time.perf_counter()
    algo = config.build_algo()
    ret, steps = float("nan"), 0
    try:
        while time.perf_counter() - t0 < cap_s:
            result = algo.train()
            runners = result.get("env_runners", {})
            ret = float(runners.get("episode_return_mean", float("nan")))
            steps = int(runners.get("num_env_steps_sampled_lifetime", steps))
            if ret >= TARGET:
                break
    finally:
        algo.stop()
    return time.perf_counter() - t0, steps, ret


def _solved(ret: float) -> str:
    return "solved" if ret >= TARGET else "NOT solved (cap)"


def local_part(cap_s: float, skip_rllib: bool) -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        a_wall, a_steps, a_ret, _ = raylane_solve("impala", cap_s)
        print(f"raylane impala (APPO loss): {_solved(a_ret)} return {a_ret:.1f} in {a_wall:.1f} s, {a_steps:,} env steps")
        p_wall, p_steps, p_ret, _ = raylane_solve("ppo", cap_s)
        print(f"raylane ppo:                {_solved(p_ret)} return {p_ret:.1f} in {p_wall:.1f} s, {p_steps:,} env steps")
        if not skip_rllib:
            l_wall, l_steps, l_ret = rllib_appo_solve(cap_s)
            print(f"RLlib APPO:                 {_solved(l_ret)} return {l_ret:.1f} in {l_wall:.1f} s, {l_steps:,} env steps")
            print(f"time to 475 raylane impala / RLlib APPO = {a_wall / l_wall:.2f} (target <= 0.5)"
                  + ("" if l_ret >= TARGET else " (RLlib capped: an upper bound)"))
    finally:
        ray.shutdown()


def _rate(job: str, rows: list[dict]) -> float:
    rows = rows[1:] or rows
    if job == "impala":
        return statistics.median(r["updates_per_s"] for r in rows)
    return statistics.median(1.0 / (r["sample_s"] + r["learn_s"]) for r in rows)


def cluster_part(cap_s: float, emulate: float) -> None:
    from raylane.testing.spotmarket import SpotMarket

    market = SpotMarket(head_cpus=2)
    try:
        ray.init(address=market.address, log_to_driver=False)
        for name, speed in (("spot-1", 1.0), ("spot-2", 2.0)):
            market.add_node("spot", speed=speed, cpus=2, name=name)
        time.sleep(3)
        common = [f"emulate_step_s={emulate}", "worker_cpus=2"]
        rates = {}
        for job, steps in (("impala", 8), ("ppo", 15)):
            *_, rows = raylane_solve(job, cap_s, *common, "target_return=null", f"driver.max_steps={steps}")
            rates[job] = [_rate(job, rows)]
        market.add_node("spot", speed=0.25, cpus=2, name="spot-slow")
        time.sleep(3)
        solve = {}
        for job, steps in (("impala", 8), ("ppo", 15)):
            *_, rows = raylane_solve(job, cap_s, *common, "workers=3", "target_return=null", f"driver.max_steps={steps}")
            rates[job].append(_rate(job, rows))
            solve[job] = raylane_solve(job, cap_s, *common, "workers=3")[:3]
        for job, word in (("impala", "learner updates/s"), ("ppo", "iterations/s")):
            fast, slow = rates[job]
            print(f"{job}: {word} {fast:.2f} without the 4x-slow node, {slow:.2f} with it ({slow / fast:.2f}x)")
        for job in ("impala", "ppo"):
            wall, steps, ret = solve[job]
            print(f"{job} with the 4x-slow node: {_solved(ret)} return {ret:.1f} in {wall:.1f} s, {steps:,} env steps")
        print(f"time to 475 with the slow node impala / ppo = {solve['impala'][0] / solve['ppo'][0]:.2f} (target < 1)")
    finally:
        ray.shutdown()
        market.shutdown()
