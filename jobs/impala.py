"""``raylane run impala``: asynchronous RL. Streaming rollout workers feed a learner that
never waits for the slowest of them; V-trace corrects for the policy lag.

Why a job of its own rather than ``ppo --set mode=async``: the loop, the batch and the
knobs differ (fragments instead of iterations, a staleness bound and a learner queue
instead of a sampling deadline), and ``ppo`` stays the synchronous reference.

The loop: every live worker holds two ``fragment`` calls (the second waits in its own
queue, so it samples without a pause); each call carries a reference to the newest
weights. Finished fragments go into the learner queue (at most ``queue_depth``; when
full, no new calls go out beyond one per worker, and the oldest fragment gives way to a
new one). The driver holds the fragments' object references and hands them to the
learner's update; the task pool also fetches each result to the driver to account for
it (env steps, returns, versions), so a fragment crosses the driver once. An update
takes the ``fragments_per_update`` oldest fragments within ``max_staleness`` versions of
the learner (older ones are dropped and counted), from whichever workers made them,
and runs while the driver keeps collecting. A driver step is ``updates_per_step``
updates. A worker that dies costs the fragments it held; nothing waits for it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import ray

from raylane import config as cfg
from raylane.actors import policy_export
from raylane.actors.impala_learner import ImpalaLearnerActor, ImpalaLearnerConfig
from raylane.actors.rollout_worker import RolloutConfig
from raylane.actors.stream_worker import StreamConfig, StreamWorker
from raylane.actors.vtrace import split_stale
from raylane.api import BaseWorkload, Context, DriverConfig, Gang, JobSpec, Part, PoolError, RoleSpec, TaskPool
from raylane.jobs.ppo import RETURN_WINDOW, plot_returns
from raylane.jobs.rl_env import RLEnvConfig, RLInputs, announce_emulation, check_budget, export_policy, resolve
from raylane.launch import job_main

WORKERS, LEARNER = "rollout_worker", "learner"


@dataclass
class ImpalaConfig(RLEnvConfig):
    """IMPALA/APPO on a gymnasium environment. Defaults solve CartPole-v1."""

    loss: Literal["vtrace", "appo"] = "appo"
    """``appo``: PPO's clipped surrogate on V-trace advantages (steadier, the default);
    ``vtrace``: IMPALA's policy gradient weighted by V-trace advantages (wants a lower lr,
    e.g. 5e-4, or it can collapse)."""
    workers: int = cfg.field(2, ge=1)
    """Rollout worker actors (at least 1: the learner has nothing to learn from without)."""
    max_workers: int = cfg.field(16, ge=1)
    """Most rollout workers the pool may grow to."""
    envs_per_worker: int = cfg.field(8, ge=1)
    """Env copies per worker on a speed-1 node (see envs_by_speed)."""
    envs_by_speed: bool = True
    """Scale a worker's env copies by its node's ``raylane.io/speed`` label (a speed-2 node
    steps twice as many), so workers hand back fragments at similar rates."""
    fragment_length: int = cfg.field(50, ge=1)
    """Steps of every env copy per fragment."""
    worker_cpus: float = cfg.field(0.5, gt=0)
    """CPUs reserved per rollout worker."""
    fragments_per_update: int = cfg.field(2, ge=1)
    """Fragments in one learner update (from whichever workers made them)."""
    updates_per_step: int = cfg.field(10, ge=1)
    """Learner updates per driver step (checkpoints and metrics count driver steps)."""
    max_staleness: int = cfg.field(8, ge=0)
    """A fragment made by a policy more than this many versions older than the learner's
    is dropped (and counted) instead of learned from."""
    queue_depth: int = cfg.field(4, ge=1)
    """Most fragments waiting for the learner or being made for it (at least
    fragments_per_update). Bounds memory and staleness: a learner slower than its workers
    then sees fragments about queue_depth / fragments_per_update versions old."""
    total_env_steps: int = cfg.field(500_000, ge=1)
    """Stop after this many environment steps (sampled, learned from or not)."""
    target_return: float | None = 475.0
    """Stop once the mean return of the last 100 episodes reaches this; null to run all steps."""
    lr: float = cfg.field(2e-3, gt=0)
    """Adam learning rate."""
    anneal: bool = True
    """Anneal the learning rate linearly over total_env_steps."""
    gamma: float = cfg.field(0.99, gt=0, le=1)
    """Discount factor."""
    vtrace_lambda: float = cfg.field(0.95, ge=0, le=1)
    """V-trace's trace-cutting lambda (1: plain V-trace; the paper's section 4.2 variant below 1)."""
    rho_clip: float = cfg.field(1.0, gt=0)
    """V-trace's rho bar: clip of the importance weights (> 0)."""
    c_clip: float = cfg.field(1.0, gt=0)
    """V-trace's c bar: clip of the trace coefficients (> 0)."""
    clip: float = cfg.field(0.2, gt=0)
    """APPO's surrogate clip range (loss=appo)."""
    passes: int = cfg.field(4, ge=1)
    """Gradient steps on each batch."""
    ent_coef: float = cfg.field(0.0, ge=0)
    """Entropy bonus coefficient."""
    vf_coef: float = cfg.field(0.5, ge=0)
    """Value loss coefficient."""
    max_grad_norm: float = cfg.field(0.5, gt=0)
    """Gradient clipping norm."""
    reward_scale: float = cfg.field(1.0, gt=0)
    """Multiply rewards by this before V-trace."""
    fragment_timeout_s: float = cfg.field(60.0, gt=0)
    """Longest the learner waits for enough fragments (every worker gone, none back): then the step fails."""
    learner_timeout_s: float = cfg.field(300.0, gt=0)
    """Longest one learner call (an update, weights, state) may take before the learner counts as lost and is replaced from the last checkpoint."""
    seed: int = 0
    """Base seed: worker k seeds its env copies with seed + 1000 * (k + 1) + i."""
    plot: bool = True
    """Write return_vs_steps.png into the run folder at the end."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=1_000_000, checkpoint_every_steps=10))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        if self.workers > self.max_workers:
            raise ValueError(f"workers ({self.workers}) must not exceed max_workers ({self.max_workers})")
        if self.queue_depth < self.fragments_per_update:
            raise ValueError(f"queue_depth ({self.queue_depth}) must be at least fragments_per_update "
                             f"({self.fragments_per_update}): an update takes that many fragments from the queue")


class ImpalaWorkload(BaseWorkload):
    name = "impala"
    main_metric = "return_mean"
    guarded_metrics = ("loss",)
    metrics = ("return_mean", "env_steps", "env_steps_per_s", "updates_per_s", "episodes", "workers", "staleness_mean", "staleness_max", "dropped_stale", "dropped_full", "lost_fragments", "learner_wait_s", "learner_wait_max_s", "fragment_s_max", "loss", "policy_loss", "value_loss", "entropy", "rho_mean", "rho_clipped", "lr")
    progress_metrics = ("env_steps", "updates_per_s", "return_mean")

    def __init__(self, config: ImpalaConfig, inputs: RLInputs | None = None):
        """``inputs``: the env and network as :func:`raylane.jobs.rl_env.resolve` checked them (the job's prepare); read here when None."""
        self.config = config
        self.recipe, self.net, self.spec = inputs if inputs is not None else resolve(config)
        # At a speed-1 node (envs_by_speed scales a faster node's copies up). The driver
        # fetches every fragment: queue_depth wait for the learner, and each of up to
        # max_workers workers has one more on its way; an update takes fragments_per_update
        # (as tensors too: 3 copies).
        c = config
        check_budget(self.name, c, self.spec, steps=c.fragment_length, steps_key="fragment_length",
                     driver=(c.queue_depth + c.max_workers, f"(queue_depth ({c.queue_depth}) + max_workers ({c.max_workers}))", ("queue_depth", "max_workers")),
                     learner=(3 * c.fragments_per_update, f"3 x fragments_per_update ({c.fragments_per_update})", ("fragments_per_update",)))
        self.env_steps = self.episodes = self.dropped_stale = self.dropped_full = self.lost_fragments = 0
        self.returns: deque[float] = deque(maxlen=RETURN_WINDOW)
        self.workers: TaskPool | None = None
        self.learner: Gang | None = None
        self.version = 0
        self._box: list | None = None  # [ref to the newest weights]
        self._inflight: set[int] = set()
        self._queue: deque[tuple[dict, Any]] = deque()  # (fragment, its ObjectRef), oldest first
        self._ctx: Context | None = None
        self._nodes: dict[str, dict] = {}
        self._staleness: Counter[int] = Counter()
        self._waited, self._last_elapsed = 0.0, 1.0

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [RoleSpec(LEARNER, {"CPU": 1.0}, count=1, stateful=True, accelerator="prefer"),
                RoleSpec(WORKERS, {"CPU": c.worker_cpus}, min_count=1, max_count=c.max_workers, want=c.workers)]

    def _learner_config(self) -> ImpalaLearnerConfig:
        c = self.config
        return ImpalaLearnerConfig(spec=self.spec, net=self.net, loss=c.loss, lr=c.lr, anneal=c.anneal, gamma=c.gamma,
                                   lam=c.vtrace_lambda, rho_clip=c.rho_clip, c_clip=c.c_clip, clip=c.clip, passes=c.passes,
                                   ent_coef=c.ent_coef, vf_coef=c.vf_coef, max_grad_norm=c.max_grad_norm,
                                   reward_scale=c.reward_scale, seed=c.seed)

    def _worker_args(self, key: int) -> tuple[tuple, dict]:
        c = self.config
        rc = RolloutConfig(self.recipe, c.envs_per_worker, c.seed + 1000 * (key + 1), self.spec, self.net, c.vector, c.emulate_step_s)
        return (StreamConfig(rc, c.fragment_length, c.envs_by_speed),), {}

    def setup(self, ctx: Context) -> None:
        c = self.config
        self._ctx = ctx
        lc = self._learner_config()
        self.learner = ctx.gang(LEARNER, ImpalaLearnerActor, actor_args=lambda key: ((lc,), {}), rank_name="learner", start_timeout_s=180)
        self.workers = ctx.task_pool(WORKERS, StreamWorker, actor_args=self._worker_args, call_timeout_s=c.fragment_timeout_s, on_timeout="retry", queue_depth=2)
        announce_emulation(ctx, c.emulate_step_s)
        self.learner.form(timeout_s=180)
        self.workers.wait_ready(timeout_s=180)
        self._publish(self._learner_call("weights"))

    def _learner_part(self) -> Part:
        """The learner's snapshot for a checkpoint: it writes its own part (the driver never holds the weights)."""
        assert self.learner is not None
        return Part(self.learner.handles()[0], **self._learner_call("snapshot_part"))

    def _learner_call(self, method: str, *args: Any) -> Any:
        """The learner's answer; a lost learner raises ``GroupLost`` (only :meth:`recover`
        forms a new one, and the driver reloads the last checkpoint into it)."""
        assert self.learner is not None
        return self.learner.call(method, *args, timeout_s=self.config.learner_timeout_s, grace_s=0.0)[0]

    def _publish(self, weights: dict) -> None:
        self.version = int(weights["version"])
        self._box = [ray.put(weights)]

    # ---------------------------------------------------------------- the fragment stream

    def _top_up(self) -> None:
        """Two calls held by every live worker, while the learner queue has room for what
        they will bring (so no fragment is sampled only to be pushed out of the queue)."""
        assert self.workers is not None
        live = len(self.workers.actors())
        # every worker holds at least one call even when the queue is shallow (no idle worker
        # however many there are); the second only while the queue has room for it
        room = max(self.config.queue_depth, live)
        while len(self._inflight) < 2 * live and len(self._queue) + len(self._inflight) < room:
            self._inflight.add(self.workers.submit("fragment", self._box, retry=False))

    def _collect(self, wait_s: float) -> None:
        assert self.workers is not None
        self.workers.poll(wait_s)
        done = [t for t in self._inflight if self.workers.finished(t)]
        if not done:
            return
        try:
            got = self.workers.gather(done, timeout_s=0.0, partial=True, refs=True)
        finally:  # a ticket gathered (or failed) never counts as in flight again
            self._inflight.difference_update(done)
        self.lost_fragments += len(done) - len(got)
        for t in sorted(got):
            frag, ref = got[t]
            self._account(frag)
            self._queue.append((frag, ref))
            if len(self._queue) > self.config.queue_depth:
                self._queue.popleft()
                self.dropped_full += 1

    def _account(self, frag: dict) -> None:
        steps = int(frag["rewards"].size)
        self.env_steps += steps
        self.returns.extend(frag["episode_returns"])
        self.episodes += len(frag["episode_returns"])
        node = self._nodes.setdefault(frag["node_id"], {"speed": frag["speed"], "market": frag["market"], "steps": 0, "step_steps": 0})
        node["steps"] += steps
        node["step_steps"] += steps

    def _next_batch(self) -> tuple[list[tuple[dict, Any]], float]:
        """The oldest ``fragments_per_update`` fragments fresh enough to learn from, and how
        long the learner waited for them."""
        c = self.config
        t0 = time.monotonic()
        deadline = t0 + c.fragment_timeout_s
        while True:
            keep, drop = split_stale([int(f["version"]) for f, _ in self._queue], self.version, c.max_staleness)
            if drop:
                self.dropped_stale += len(drop)
                self._queue = deque(self._queue[i] for i in keep)
            if len(self._queue) >= c.fragments_per_update:
                batch = [self._queue.popleft() for _ in range(c.fragments_per_update)]
                self._staleness.update(self.version - int(f["version"]) for f, _ in batch)
                return batch, time.monotonic() - t0
            if not self.workers.actors():  # every worker lost: wait for the pool's replacements, not for fragments
                self.workers.wait_for(1, timeout_s=c.fragment_timeout_s)
                deadline = time.monotonic() + c.fragment_timeout_s
            if time.monotonic() >= deadline:
                raise PoolError(f"the learner got {len(self._queue)} of {c.fragments_per_update} fragments in "
                                f"fragment_timeout_s={c.fragment_timeout_s:g} s (live workers: {len(self.workers.actors())})")
            self._top_up()
            self._collect(min(0.05, max(0.0, deadline - time.monotonic())))

    def _update(self, batch: list[tuple[dict, Any]], progress: float) -> dict:
        """One learner update on ``batch``, collecting fragments while it runs."""
        assert self.learner is not None
        handles = self.learner.handles()
        if not handles:
            return self._learner_call("weights")  # raises GroupLost naming the learner
        ref = handles[0].update_fragments.remote(progress, *[r for _, r in batch])
        deadline = time.monotonic() + self.config.learner_timeout_s
        while not ray.wait([ref], timeout=0)[0] and time.monotonic() < deadline:
            self._top_up()
            self._collect(0.005)
        stats, weights = self.learner.gather({0: ref}, what="update_fragments", timeout_s=max(0.0, deadline - time.monotonic()), grace_s=0.0)[0]
        self._publish(weights)
        return stats

    # ---------------------------------------------------------------- one driver step

    def step(self, step: int) -> dict[str, Any]:
        assert self.workers is not None and self._ctx is not None
        c = self.config
        t0 = time.perf_counter()
        waits, stats_rows, frag_s = [], [], []
        for node in self._nodes.values():
            node["step_steps"] = 0
        before = self._staleness.copy()
        for _ in range(c.updates_per_step):
            self._top_up()
            batch, waited = self._next_batch()
            waits.append(waited)
            frag_s += [float(f["sample_s"]) for f, _ in batch]
            stats_rows.append(self._update(batch, min(1.0, self.env_steps / c.total_env_steps)))
        elapsed = self._last_elapsed = time.perf_counter() - t0
        self._waited = sum(waits) / max(elapsed, 1e-9)
        used = self._staleness - before
        nums = [k for k, n in used.items() for _ in range(n)]
        if step % 10 == 0:
            self._log_sampling(elapsed)
        keys = dict.fromkeys(k for r in stats_rows for k in r if k != "applied")  # a refused (NaN) update has fewer keys
        stats = {k: float(np.mean([r.get(k, np.nan) for r in stats_rows])) for k in keys}
        return {
            "env_steps": self.env_steps,
            "env_steps_per_s": sum(n["step_steps"] for n in self._nodes.values()) / max(elapsed, 1e-9),
            "updates_per_s": c.updates_per_step / max(elapsed, 1e-9),
            "return_mean": float(np.mean(self.returns)) if self.returns else None,  # None: no episode has ended yet (NaN would trip the guard)
            "episodes": self.episodes,
            "workers": len(self.workers.actors()),
            "staleness_mean": float(np.mean(nums)), "staleness_max": int(max(nums)),
            "dropped_stale": self.dropped_stale, "dropped_full": self.dropped_full, "lost_fragments": self.lost_fragments,
            "learner_wait_s": sum(waits), "learner_wait_max_s": max(waits), "fragment_s_max": max(frag_s),
            **stats,
        }

    def _log_sampling(self, elapsed: float) -> None:
        """Where the samples come from: env steps per second of each node in the last step,
        and how stale the learned-from fragments have been so far."""
        assert self._ctx is not None
        nodes = {nid[:12]: {"speed": n["speed"], "market": n["market"], "env_steps": n["steps"],
                            "env_steps_per_s": round(n["step_steps"] / max(elapsed, 1e-9), 1)} for nid, n in self._nodes.items()}
        self._ctx.log.event("sampling", nodes=nodes, staleness={str(k): v for k, v in sorted(self._staleness.items())},
                            dropped_stale=self.dropped_stale, lost_fragments=self.lost_fragments)

    def waits(self) -> dict[str, float]:
        """For the pool autoscaler: the share of the last step the learner waited for fragments."""
        return {WORKERS: self._waited}

    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str]:
        return self.env_steps, self.config.total_env_steps, "env steps"

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        c = self.config
        if self.env_steps >= c.total_env_steps:
            return True
        return c.target_return is not None and len(self.returns) >= RETURN_WINDOW and float(np.mean(self.returns)) >= c.target_return

    # ---------------------------------------------------------------- state and faults

    def state_dict(self) -> dict:
        return {"learner": self._learner_part(), "env_steps": self.env_steps, "episodes": self.episodes,
                "returns": list(self.returns), "dropped_stale": self.dropped_stale, "lost_fragments": self.lost_fragments,
                "dropped_full": self.dropped_full, "staleness": {str(k): v for k, v in self._staleness.items()},
                "nodes": {nid: {"speed": float(n["speed"]), "market": str(n["market"]), "steps": int(n["steps"])} for nid, n in self._nodes.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._learner_call("load_part", state["learner"])  # the learner reads its own part (or takes a replica)
        self.env_steps, self.episodes = int(state["env_steps"]), int(state["episodes"])
        self.returns = deque((float(x) for x in state["returns"]), maxlen=RETURN_WINDOW)
        self.dropped_stale, self.lost_fragments = int(state["dropped_stale"]), int(state["lost_fragments"])
        self._staleness = Counter({int(k): int(v) for k, v in state["staleness"].items()})
        self.dropped_full = int(state.get("dropped_full", 0))  # absent from checkpoints written before it was kept
        self._nodes = {nid: {**n, "step_steps": 0} for nid, n in state.get("nodes", {}).items()}
        # Fragments made by policies of the abandoned line: their versions mean nothing now.
        if self.workers is not None and self._inflight:
            self.workers.cancel(self._inflight)
        self._inflight.clear()
        self._queue.clear()
        self._publish(self._learner_call("weights"))

    def finish(self, ctx: Context) -> None:
        self._log_sampling(self._last_elapsed)
        if self.config.plot:
            plot_returns(ctx.run_dir, title="IMPALA" if self.config.loss == "vtrace" else "APPO")


JOB = JobSpec("impala", "Asynchronous RL (IMPALA/APPO with V-trace): streaming rollout workers on spot, a learner that never waits for the slowest.", ImpalaConfig, ImpalaWorkload,
              prepare=resolve, export=export_policy, load_model=policy_export.load)

if __name__ == "__main__":
    job_main(JOB)
