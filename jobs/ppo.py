"""``raylane run ppo``: PPO with rollout workers on (spot) actors feeding one learner.

Each iteration: the newest weights go out once through the object store with the
``sample`` calls, every ready rollout worker samples ``rollout_steps`` steps of each
of its env copies, the iteration goes on with the samples of the workers that
answered by the deadline (a worker lost mid-iteration costs its samples, never a
stall; when every worker was lost, their replacements sample again), and the learner
runs several epochs of PPO on them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from raylane import config as cfg
from raylane.actors import policy_export
from raylane.actors.ppo_learner import LearnerActor, LearnerConfig
from raylane.actors.rollout_worker import RolloutConfig, RolloutWorker
from raylane.api import BaseWorkload, Context, DriverConfig, Gang, JobSpec, Part, PoolError, RoleSpec, TaskPool
from raylane.jobs.rl_env import RLEnvConfig, RLInputs, announce_emulation, check_budget, export_policy, resolve
from raylane.launch import job_main
from raylane.runlog import read_jsonl

WORKERS, LEARNER = "rollout_worker", "learner"
RETURN_WINDOW = 100


@dataclass
class PPOConfig(RLEnvConfig):
    """PPO on a gymnasium environment. Defaults solve CartPole-v1 in well under two minutes on 2 cores."""

    workers: int = cfg.field(2, ge=1)
    """Rollout worker actors."""
    max_workers: int = cfg.field(16, ge=1)
    """Most rollout workers the pool may grow to."""
    envs_per_worker: int = cfg.field(8, ge=1)
    """Environment copies per worker, stepped as one vector env."""
    rollout_steps: int = cfg.field(32, ge=1)
    """Steps of every env copy per iteration (batch = workers x envs_per_worker x rollout_steps)."""
    worker_cpus: float = cfg.field(0.5, gt=0)
    """CPUs reserved per rollout worker."""
    total_env_steps: int = cfg.field(500_000, ge=1)
    """Stop after this many environment steps."""
    target_return: float | None = 475.0
    """Stop once the mean return of the last 100 episodes reaches this; null to run all steps."""
    lr: float = cfg.field(2e-3, gt=0)
    """Adam learning rate."""
    anneal: bool = True
    """Anneal learning rate and clip range linearly over total_env_steps."""
    gamma: float = cfg.field(0.98, gt=0, le=1)
    """Discount factor."""
    gae_lambda: float = cfg.field(0.8, ge=0, le=1)
    """GAE lambda."""
    clip: float = cfg.field(0.2, gt=0)
    """PPO clip range."""
    epochs: int = cfg.field(10, ge=1)
    """Passes over each batch."""
    minibatches: int = cfg.field(1, ge=1)
    """Minibatches per epoch."""
    ent_coef: float = cfg.field(0.0, ge=0)
    """Entropy bonus coefficient."""
    vf_coef: float = cfg.field(0.5, ge=0)
    """Value loss coefficient."""
    max_grad_norm: float = cfg.field(0.5, gt=0)
    """Gradient clipping norm."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    normalize_obs: bool = False
    """Normalise observations with running statistics (helps Pendulum-like envs)."""
    reward_scale: float = cfg.field(1.0, gt=0)
    """Multiply rewards by this before computing advantages (0.1 suits Pendulum's -16..0 rewards)."""
    overlap: bool = True
    """Sample the next batch while the learner updates on this one. The next batch then
    comes from the policy one update old; PPO's ratio against the recorded behaviour
    log-probabilities accounts for that, and sampling time disappears from the loop."""
    sample_timeout_s: float = cfg.field(60.0, gt=0)
    """Deadline for one iteration's sampling; workers that miss it are left out of that iteration."""
    seed: int = 0
    """Base seed: worker k seeds its env copies with seed + 1000 * (k + 1) + i."""
    plot: bool = True
    """Write return_vs_steps.png into the run folder at the end."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=1_000_000, checkpoint_every_steps=10))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        if self.workers > self.max_workers:
            raise ValueError(f"workers ({self.workers}) must not exceed max_workers ({self.max_workers})")
        batch = self.workers * self.envs_per_worker * self.rollout_steps
        if self.minibatches > batch:
            # The learner would quietly train on minibatches of one sample, `batch` of them.
            raise ValueError(f"minibatches ({self.minibatches}) must not exceed the samples per batch: workers ({self.workers}) "
                             f"x envs_per_worker ({self.envs_per_worker}) x rollout_steps ({self.rollout_steps}) = {batch}; "
                             f"lower minibatches to at most {batch}, or raise rollout_steps, envs_per_worker or workers")


class PPOWorkload(BaseWorkload):
    name = "ppo"
    main_metric = "return_mean"
    guarded_metrics = ("loss",)
    metrics = ("return_mean", "env_steps", "env_steps_per_s", "episodes", "workers", "lost_batches", "sample_s", "learn_s", "loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "lr")
    progress_metrics = ("env_steps", "env_steps_per_s", "return_mean")

    def __init__(self, config: PPOConfig, inputs: RLInputs | None = None):
        """``inputs``: the env and network as :func:`raylane.jobs.rl_env.resolve` checked them (the job's prepare); read here when None."""
        self.config = config
        self.recipe, self.net, self.spec = inputs if inputs is not None else resolve(config)
        # The pool may grow to max_workers; the driver gathers every worker's fragment and
        # hands them on (2 copies), the learner turns them into tensors and advantages (3).
        check_budget(self.name, config, self.spec, steps=config.rollout_steps, steps_key="rollout_steps",
                     driver=(2 * config.max_workers, f"2 x max_workers ({config.max_workers})", ("max_workers",)),
                     learner=(3 * config.max_workers, f"3 x max_workers ({config.max_workers})", ("max_workers",)))
        self.env_steps = 0
        self.episodes = 0
        self.returns: deque[float] = deque(maxlen=RETURN_WINDOW)
        self.workers: TaskPool | None = None
        self.learner: Gang | None = None  # a gang of one
        self._weights_ref = None
        self._seeds_logged: set[int] = set()
        self._inflight: list[int] | None = None
        self._ctx: Context | None = None
        self._waited = 0.0

    # ---------------------------------------------------------------- roles and set-up

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [
            RoleSpec(LEARNER, {"CPU": 1.0}, count=1, stateful=True, accelerator="prefer"),
            RoleSpec(WORKERS, {"CPU": c.worker_cpus}, min_count=1, max_count=c.max_workers, want=c.workers),
        ]

    def _learner_config(self) -> LearnerConfig:
        c = self.config
        return LearnerConfig(
            spec=self.spec, net=self.net, lr=c.lr, anneal=c.anneal, gamma=c.gamma, lam=c.gae_lambda, clip=c.clip,
            epochs=c.epochs, minibatches=c.minibatches, ent_coef=c.ent_coef, vf_coef=c.vf_coef, max_grad_norm=c.max_grad_norm,
            norm_adv=c.norm_adv, normalize_obs=c.normalize_obs, reward_scale=c.reward_scale, seed=c.seed,
        )

    def _worker_args(self, key: int) -> tuple[tuple, dict]:
        c = self.config
        # Each worker (and each replacement: keys are never reused) gets its own seed
        # range, so no two env copies in a run share a seed.
        rc = RolloutConfig(self.recipe, c.envs_per_worker, c.seed + 1000 * (key + 1), self.spec, self.net, c.vector, c.emulate_step_s)
        return (rc,), {}

    def setup(self, ctx: Context) -> None:
        c = self.config
        self._ctx = ctx
        lc = self._learner_config()
        announce_emulation(ctx, c.emulate_step_s)
        self.learner = ctx.gang(LEARNER, LearnerActor, actor_args=lambda key: ((lc,), {}), rank_name="learner", start_timeout_s=180)
        self.workers = ctx.task_pool(WORKERS, RolloutWorker, actor_args=self._worker_args, call_timeout_s=c.sample_timeout_s, on_timeout="retry")
        self.learner.form(timeout_s=180)
        self.workers.wait_ready(timeout_s=180)
        self._refresh_weights()

    def _learner_part(self) -> Part:
        """The learner's snapshot for a checkpoint: it writes its own part (the driver never holds the weights)."""
        assert self.learner is not None
        return Part(self.learner.handles()[0], **self._learner_call("snapshot_part"))

    def _learner_call(self, method: str, *args: Any) -> Any:
        """The one learner's answer. Its state is the job's state, so a learner lost at any
        time (in a call or idle between two) raises ``GroupLost``: only :meth:`recover`
        forms the gang again, and the driver then reloads the last checkpoint into the
        replacement. Forming here would hand the call to a fresh learner and lose its
        training without a word."""
        assert self.learner is not None
        return self.learner.call(method, *args, timeout_s=300, grace_s=0.0)[0]

    def _refresh_weights(self) -> None:
        self._weights_ref = ray.put(self._learner_call("weights"))

    # ---------------------------------------------------------------- one iteration

    def _submit_samples(self, timeout_s: float) -> list[int]:
        assert self.workers is not None
        c = self.config
        ready = len(self.workers.actors())
        if ready == 0:
            self.workers.wait_for(1, timeout_s=max(timeout_s, 0.01))  # not the full target: capacity may be gone
            ready = len(self.workers.actors())
        return [self.workers.submit("sample", self._weights_ref, c.rollout_steps, retry=False) for _ in range(ready)]

    def _sample(self) -> tuple[list[dict], int]:
        """This iteration's samples and how many calls brought none. When every call was
        lost with its worker (all of them sat on a spot node that just went), the
        replacements sample again with the same weights until the deadline: the learner's
        state is untouched, so failing the step (and rolling back to the checkpoint)
        would only throw away steps."""
        assert self.workers is not None
        c = self.config
        deadline = time.monotonic() + c.sample_timeout_s
        tickets = self._inflight or self._submit_samples(c.sample_timeout_s)
        self._inflight = None
        missed = 0
        while True:
            done = self.workers.gather(tickets, timeout_s=max(0.0, deadline - time.monotonic()), partial=True)
            missed += len(tickets) - len(done)
            if done:
                return [done[t] for t in tickets if t in done], missed
            if not self.workers.lost() or time.monotonic() >= deadline:
                raise PoolError(f"no rollout worker returned samples within sample_timeout_s={c.sample_timeout_s:g} s")
            tickets = self._submit_samples(deadline - time.monotonic())

    def step(self, step: int) -> dict[str, Any]:
        assert self.workers is not None and self.learner is not None and self._ctx is not None
        c = self.config
        t0 = time.perf_counter()
        batches, missed = self._sample()
        if c.overlap and self.workers.actors():  # none ready: the next step waits for one instead
            self._inflight = self._submit_samples(c.sample_timeout_s)
        t1 = time.perf_counter()
        new_steps = 0
        for b in batches:
            new_steps += b["rewards"].size
            self.returns.extend(b["episode_returns"])
            self.episodes += len(b["episode_returns"])
            first = b["seeds"][0]
            if first not in self._seeds_logged:
                self._seeds_logged.add(first)
                self._ctx.log.event("worker_seeds", env=c.env_id, seeds=b["seeds"])
        self.env_steps += new_steps
        progress = min(1.0, self.env_steps / c.total_env_steps)
        stats, weights = self._learner_call("update", [_strip(b) for b in batches], progress)
        self._weights_ref = ray.put(weights)
        t2 = time.perf_counter()
        self._waited = (t1 - t0) / max(t2 - t0, 1e-9)
        return {
            "env_steps": self.env_steps,
            "env_steps_per_s": new_steps / max(t2 - t0, 1e-9),
            "return_mean": float(np.mean(self.returns)) if self.returns else None,  # None: no episode has ended yet (NaN would trip the guard)
            "episodes": self.episodes,
            "workers": len(batches),
            "lost_batches": missed,
            "sample_s": t1 - t0,
            "learn_s": t2 - t1,
            **{k: v for k, v in stats.items() if k != "applied"},
        }

    def waits(self) -> dict[str, float]:
        """For the pool autoscaler: the share of the last step the learner waited for samples."""
        return {WORKERS: self._waited}

    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str]:
        """Env steps toward total_env_steps (the target return may end the run sooner)."""
        return self.env_steps, self.config.total_env_steps, "env steps"

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        c = self.config
        if self.env_steps >= c.total_env_steps:
            return True
        return c.target_return is not None and len(self.returns) >= RETURN_WINDOW and float(np.mean(self.returns)) >= c.target_return

    # ---------------------------------------------------------------- state and faults

    def state_dict(self) -> dict:
        return {
            "learner": self._learner_part(),
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "returns": list(self.returns),
        }

    def load_state_dict(self, state: dict) -> None:
        self._learner_call("load_part", state["learner"])  # the learner reads its own part (or takes a replica)
        self.env_steps = int(state["env_steps"])
        self.episodes = int(state["episodes"])
        self.returns = deque((float(x) for x in state["returns"]), maxlen=RETURN_WINDOW)
        if self._inflight and self.workers is not None:
            self.workers.cancel(self._inflight)  # sampled with weights that were just replaced
        self._inflight = None
        self._refresh_weights()

    def finish(self, ctx: Context) -> None:
        if self.config.plot:
            plot_returns(ctx.run_dir)


def _strip(batch: dict) -> dict:
    """Only what the learner reads travels to it."""
    keep = ("obs", "raw_obs", "actions", "logp", "values", "rewards", "terminated", "truncated", "final_values", "last_values")
    return {k: batch[k] for k in keep}


def plot_returns(run_dir, title: str = "PPO") -> str:
    """return_vs_steps.png beside summary.json: mean return (last 100 episodes) against env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("return_mean"), (int, float))]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([r["env_steps"] for r in rows], [r["return_mean"] for r in rows])
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean return (last 100 episodes)")
    ax.set_title(f"{title}: {run_dir.name}")
    ax.grid(alpha=0.3)
    path = run_dir / "return_vs_steps.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


JOB = JobSpec("ppo", "PPO on gymnasium envs: rollout workers (spot-friendly) feeding one learner; solves CartPole-v1 by default.", PPOConfig, PPOWorkload, prepare=resolve,
              export=export_policy, load_model=policy_export.load)

if __name__ == "__main__":
    job_main(JOB)
