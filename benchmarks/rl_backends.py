"""PPO sampling per vector-env backend: raylane's rollout workers against a bare loop
of the same gymnasium backend with random actions (the ceiling without a policy or Ray).

For each backend (``sync``: every env copy in the sampling process; ``async``: one
subprocess per copy; ``envpool``: envpool's C++ envs, if installed), in one process tree
and one local Ray:
- bare loop: one vector env of WORKERS x ENVS copies stepped with random actions here;
- bare loop + policy: raylane's own sampling code (policy inference included) in this process;
- raylane: WORKERS rollout-worker actors of ENVS copies each, sampled through the task pool,
  as ``ppo`` calls them (one call per worker, all gathered) and as ``impala`` streams them
  (two calls held by every worker, fragments taken as they come).
Each is timed for about ``--seconds`` after a warm-up, and the ratio raylane / bare is printed.

    python benchmarks/rl_backends.py [--env CartPole-v1] [--seconds 8] [--workers 2] [--envs 8]
    python benchmarks/rl_backends.py --backends envpool --env Hopper-v4   # an env whose step costs more than the policy

On envpool's CartPole the env step costs a fraction of a microsecond in C++, less than the
policy's inference: no sampler that acts with a network can come near a loop of random
actions there, and "raylane / (bare + policy)" is the figure that shows Ray's own cost.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import ray


def timed(step, seconds: float) -> float:
    """Steps per second of ``step()`` (which returns the env steps it made) over ``seconds``."""
    step()  # warm-up
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        done += step()
    return done / (time.perf_counter() - t0)


def bare(env_id: str, backend: str, n: int, seconds: float) -> float:
    from raylane.actors.envs import make_vector_env

    if backend == "envpool":  # envpool itself (NEXT_STEP autoreset), without raylane's SAME_STEP adapter
        import envpool
        from gymnasium.vector.utils import batch_space

        env = envpool.make_gymnasium(env_id, num_envs=n, seed=0)
        space = batch_space(env.action_space, n)
        env.reset()
    else:
        env = make_vector_env(env_id, n, backend)
        space = env.action_space
        env.reset(seed=0)
    space.seed(0)

    def step() -> int:
        for _ in range(64):
            env.step(space.sample())
        return 64 * n

    try:
        return timed(step, seconds)
    finally:
        env.close()


def spec_of(env_id: str, backend: str):
    """The env's spaces: envpool's own for its ids (some have no gymnasium twin installed)."""
    from raylane.jobs.rl_env import EnvRecipe, check_env, envpool_spec

    return envpool_spec(EnvRecipe(env_id)) if backend == "envpool" else check_env(env_id)


def bare_with_policy(env_id: str, backend: str, n: int, seconds: float) -> float:
    from raylane.actors.rollout_worker import RolloutConfig, Sampler

    s = Sampler(RolloutConfig(env_id, n, 0, spec_of(env_id, backend), vector=backend))
    try:
        return timed(lambda: s.sample(64)["rewards"].size, seconds)
    finally:
        s.env.close()


def raylane(env_id: str, backend: str, workers: int, envs: int, seconds: float) -> float:
    from raylane.actors.ppo_learner import Learner, LearnerConfig
    from raylane.actors.rollout_worker import RolloutConfig, RolloutWorker
    from raylane.api import TaskPool
    from raylane.api import RoleSpec

    spec = spec_of(env_id, backend)
    weights = ray.put(Learner(LearnerConfig(spec=spec)).weights())
    pool = TaskPool(RoleSpec("w", {"CPU": 0.5}, count=workers), RolloutWorker,
                    actor_args=lambda k: ((RolloutConfig(env_id, envs, 1000 * k, spec, vector=backend),), {}))
    pool.wait_ready(120)

    def step() -> int:
        out = pool.gather([pool.submit("sample", weights, 256) for _ in range(workers)], timeout_s=120)
        return sum(b["rewards"].size for b in out.values())

    try:
        return timed(step, seconds)
    finally:
        pool.shutdown()


def raylane_stream(env_id: str, backend: str, workers: int, envs: int, seconds: float) -> float:
    """``impala``'s streaming workers: two fragment calls held by every worker, so a worker
    starts its next fragment the moment it hands one back (no round trip between)."""
    from raylane.actors.ppo_learner import Learner, LearnerConfig
    from raylane.actors.rollout_worker import RolloutConfig
    from raylane.actors.stream_worker import StreamConfig, StreamWorker
    from raylane.api import TaskPool
    from raylane.api import RoleSpec

    spec = spec_of(env_id, backend)
    box = [ray.put(Learner(LearnerConfig(spec=spec)).weights())]
    pool = TaskPool(RoleSpec("w", {"CPU": 0.5}, count=workers), StreamWorker, queue_depth=2,
                    actor_args=lambda k: ((StreamConfig(RolloutConfig(env_id, envs, 1000 * k, spec, vector=backend), 256),), {}))
    pool.wait_ready(120)
    inflight: set[int] = set()

    def step() -> int:
        while len(inflight) < 2 * workers:
            inflight.add(pool.submit("fragment", box))
        pool.poll(0.05)
        done = [t for t in inflight if pool.finished(t)]
        inflight.difference_update(done)
        return sum(f["rewards"].size for f in pool.gather(done, timeout_s=0).values())

    try:
        return timed(step, seconds)
    finally:
        pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--envs", type=int, default=8, help="env copies per worker")
    ap.add_argument("--backends", default="sync,async,envpool", help="envpool is skipped when it is not installed")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    n = args.workers * args.envs
    for backend in args.backends.split(","):
        if backend == "envpool" and importlib.util.find_spec("envpool") is None:
            print('envpool: not installed (pip install "raylane[envpool]"), skipped')
            continue
        b = bare(args.env, backend, n, args.seconds)
        p = bare_with_policy(args.env, backend, n, args.seconds)
        r = raylane(args.env, backend, args.workers, args.envs, args.seconds)
        st = raylane_stream(args.env, backend, args.workers, args.envs, args.seconds)
        print(f"{backend:5s} {args.env}: bare loop {b:,.0f} steps/s; bare loop + policy {p:,.0f}; "
              f"raylane {args.workers} workers x {args.envs} envs: ppo's calls {r:,.0f}, impala's stream {st:,.0f}")
        print(f"      raylane / bare = ppo {r / b:.2f}, impala {st / b:.2f}; raylane / (bare + policy) = ppo {r / p:.2f}, impala {st / p:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
