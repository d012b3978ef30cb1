"""RL benchmark: raylane PPO against RLlib PPO to a CartPole-v1 return of 475, and
raylane's sampling against a plain gymnasium loop without Ray (the ceiling).

All runs share one process tree and one local Ray, with the same number of env
runners (2) and envs per runner (8, raylane's default). RLlib uses its tuned CartPole-v1 example
settings (lr 3e-4, 6 epochs, vf_loss_coeff 0.01, one hidden layer of 32, linear,
shared value layers). Needs `pip install "ray[rllib]"` for the RLlib part.

    python benchmarks/rl.py [--cap-s 600] [--skip-rllib]
    python benchmarks/rl.py --async [--emulate 0.002]   # the asynchronous part: benchmarks/rl_async.py
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import ray

WORKERS, ENVS, TARGET = 2, 8, 475.0


def ceiling_env_only(steps: int) -> float:
    """SyncVectorEnv with random actions: pure environment stepping."""
    from raylane.actors.rollout_worker import make_vector_env

    env = make_vector_env("CartPole-v1", WORKERS * ENVS)
    env.reset(seed=0)
    t0 = time.perf_counter()
    for _ in range(steps // (WORKERS * ENVS)):
        env.step(env.action_space.sample())
    return steps / (time.perf_counter() - t0)


def ceiling_with_policy(steps: int) -> float:
    """The same rollout code raylane's workers run, in this process, one vector env of all the envs."""
    from raylane.actors.rollout_worker import RolloutConfig, Sampler
    from raylane.jobs.rl_env import check_env

    s = Sampler(RolloutConfig("CartPole-v1", WORKERS * ENVS, 0, check_env("CartPole-v1")))
    s.sample(32)
    t0 = time.perf_counter()
    per = 256
    for _ in range(steps // (WORKERS * ENVS * per)):
        s.sample(per)
    return steps / (time.perf_counter() - t0)


def raylane_sampling(steps: int) -> float:
    """The rollout-worker actors, sampled through raylane's pool."""
    from raylane.actors.ppo_learner import Learner, LearnerConfig
    from raylane.actors.rollout_worker import RolloutConfig, RolloutWorker
    from raylane.jobs.rl_env import check_env
    from raylane.api import RoleSpec
    from raylane.api import TaskPool

    spec = check_env("CartPole-v1")
    weights = ray.put(Learner(LearnerConfig(spec=spec)).weights())
    pool = TaskPool(RoleSpec("w", {"CPU": 0.5}, count=WORKERS), RolloutWorker, actor_args=lambda k: ((RolloutConfig("CartPole-v1", ENVS, 1000 * k, spec),), {}))
    pool.wait_ready(120)
    per = 256
    pool.gather([pool.submit("sample", weights, 32) for _ in range(WORKERS)], timeout_s=60)
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        out = pool.gather([pool.submit("sample", weights, per) for _ in range(WORKERS)], timeout_s=60)
        done += sum(b["rewards"].size for b in out.values())
    rate = done / (time.perf_counter() - t0)
    pool.shutdown()
    return rate


def raylane_solve(cap_s: float) -> tuple[float, int, float]:
    from raylane.api import Driver, job_config, workload

    with tempfile.TemporaryDirectory() as tmp:
        conf = job_config("ppo", {"workers": WORKERS, "envs_per_worker": ENVS, "total_env_steps": 2_000_000, "driver": {
            "run_name": "bench", "runs_dir": tmp, "max_steps": 10**6, "max_wall_s": cap_s, "progress": False, "tensorboard": False}})
        t0 = time.perf_counter()
        summary = Driver(workload("ppo", conf), conf.driver).run()
        wall = time.perf_counter() - t0
    m = summary["final_metrics"]
    return wall, int(m["env_steps"]), float(m["return_mean"])


def rllib_solve(cap_s: float) -> tuple[float, int, float]:
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=WORKERS, num_envs_per_env_runner=ENVS)
        .training(lr=0.0003, num_epochs=6, vf_loss_coeff=0.01)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32], fcnet_activation="linear", vf_share_layers=True))
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-s", type=float, default=600.0, help="wall-time cap per solve run")
    ap.add_argument("--sample-steps", type=int, default=200_000)
    ap.add_argument("--skip-rllib", action="store_true")
    ap.add_argument("--async", dest="run_async", action="store_true", help="the asynchronous part instead (impala, ppo, RLlib APPO; the slow-node cluster)")
    ap.add_argument("--emulate", type=float, default=0.002, help="--async: emulated seconds per env step on a speed-1 node")
    args = ap.parse_args()
    if args.run_async:
        import rl_async  # benchmarks/rl_async.py, beside this file

        rl_async.local_part(args.cap_s, args.skip_rllib)
        rl_async.cluster_part(args.cap_s, args.emulate)
        return
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)

    env_only = ceiling_env_only(args.sample_steps)
    with_policy = ceiling_with_policy(args.sample_steps)
    pooled = raylane_sampling(args.sample_steps)
    print(f"sampling steps/s: gymnasium SyncVectorEnv ({WORKERS * ENVS} envs, random actions) {env_only:,.0f}; "
          f"same loop with the policy, one process {with_policy:,.0f}; raylane {WORKERS} workers x {ENVS} envs {pooled:,.0f}")
    print(f"  raylane / ceiling (with policy) = {pooled / with_policy:.2f}; raylane / env-only = {pooled / env_only:.2f}")

    r_wall, r_steps, r_ret = raylane_solve(args.cap_s)
    print(f"raylane PPO: {'solved' if r_ret >= TARGET else 'NOT solved'} return {r_ret:.1f} in {r_wall:.1f} s, {r_steps:,} env steps")
    if args.skip_rllib:
        return
    l_wall, l_steps, l_ret = rllib_solve(args.cap_s)
    print(f"RLlib PPO:   {'solved' if l_ret >= TARGET else 'NOT solved (cap)'} return {l_ret:.1f} in {l_wall:.1f} s, {l_steps:,} env steps")
    print(f"time to solve raylane / RLlib = {r_wall / l_wall:.2f}" + ("" if l_ret >= TARGET else " (RLlib capped: an upper bound)"))
    print(f"env steps to solve raylane / RLlib = {r_steps / max(l_steps, 1):.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
