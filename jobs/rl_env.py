"""What every RL job shares: the env, its vector backend and the network, given by the
user and each tried before any actor starts (:func:`resolve`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from raylane import budget
from raylane import config as cfg
from raylane import imports
from raylane.budget import KiB, MiB, Estimate
from raylane.actors.envs import EnvRecipe
from raylane.actors.policy import NetConfig, PolicyFactoryError, SpaceSpec, check_factory, space_spec
from raylane.jobs import gym_envs
from raylane.runlog import say

ENV_COPY_BYTES = 16 * KiB
"""One env copy stepped in a worker's process: 8.3 KiB measured for CartPole-v1 in a
SyncVectorEnv (wrappers included), doubled for the other classic-control and toy-text envs.
An emulator (ALE) or a physics engine (MuJoCo) takes more; the bound below still holds."""
ASYNC_COPY_BYTES = 40 * MiB
"""vector=async: every copy is a subprocess with Python, numpy and gymnasium loaded."""
STEP_S = 20e-6
"""One env step of a Python env, measured: ~21 us a copy for CartPole-v1 in a SyncVectorEnv."""
MAX_FRAGMENT_SAMPLES = 1_000_000
"""Most samples one worker makes per fragment (steps x envs_per_worker): about 20 s of
stepping at :data:`STEP_S`, a third of the default sampling deadline, before the policy
runs. Far beyond it the deadline passes every time and the run sits at step 0."""


@dataclass
class RLEnvConfig:
    """The env and the network of an RL job (the base of ``ppo`` and ``impala``)."""

    env_id: str = "CartPole-v1"
    """Gymnasium environment id (Box observations; Discrete or Box actions). An env of a plugin
    package or of your own module is ``module:EnvId`` (e.g. ``ale_py:ALE/Pong-v5``)."""
    env_module: str | None = None
    """A module to import before making the env, in the driver and every rollout worker
    (the same as writing ``module:EnvId``)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gym.make``: the env's own (``env_kwargs.size=5``) or
    gymnasium's (``env_kwargs.max_episode_steps=200``)."""
    wrappers: list[str] = field(default_factory=list)
    """Wrappers applied in order to every env copy, each by import path
    (``package.module:NAME`` or ``path/to/file.py:NAME``): a callable env -> env, such as
    a gymnasium wrapper class (``gymnasium.wrappers:FlattenObservation``). A wrapper that
    needs arguments: write a function of your own that applies it."""
    vector: Literal["sync", "async", "envpool"] = "sync"
    """How a worker steps its env copies: ``sync`` in its own process (cheap envs), ``async``
    one subprocess per copy (envs whose step costs milliseconds; raise worker_cpus to match),
    ``envpool`` envpool's C++ envs in one call (ids envpool ships; no wrappers; pip install
    "raylane[envpool]")."""
    hidden: list[int] = cfg.field(default_factory=lambda: [64, 64], ge=1)
    """Hidden layer sizes of the built-in policy and value networks."""
    activation: Literal["tanh", "relu", "elu", "silu"] = "tanh"
    """Activation of the built-in networks."""
    policy: str | None = None
    """Your own network, by import path of a factory: ``factory(spec) -> nn.Module`` whose
    ``forward(obs [B, obs_dim])`` returns ``(out [B, act_dim], value [B])`` (out: action
    logits for Discrete actions, the action mean for Box). ``spec`` has obs_dim, act_dim,
    discrete. It replaces the built-in networks, so hidden and activation are then refused."""
    emulate_step_s: float = cfg.field(0.0, ge=0)
    """Tests and benchmarks only: every env step of a rollout worker sleeps
    emulate_step_s / speed (its node's raylane.io/speed label), so one machine shows what
    slow nodes do. 0 (off) in real runs; a run with it on says so."""

    @property
    def make_id(self) -> str:
        """The id rollout workers pass to ``gym.make`` (``module:EnvId`` when one is needed)."""
        if self.vector == "envpool":  # envpool's own ids, not gymnasium's registry
            if self.env_module or ":" in self.env_id:
                raise ValueError(f"vector=envpool makes only the envs envpool ships; env {self.env_id!r} of a module of "
                                 "your own needs vector=sync or async")
            return self.env_id
        return gym_envs.resolve(self.env_id, self.env_module)


def announce_emulation(ctx: Any, emulate_step_s: float) -> None:
    """Say on the terminal and in events.jsonl that env steps are being slowed on purpose."""
    if emulate_step_s > 0:
        ctx.log.event("emulated_slow_nodes", emulate_step_s=emulate_step_s)
        say(f"emulate_step_s={emulate_step_s:g}: rollout workers sleep emulate_step_s / node speed per env step "
            "(emulated slow nodes, a test setting; 0 in real runs)")


def check_env(env_id: str | EnvRecipe, env_module: str | None = None) -> SpaceSpec:
    """The env's space description; a clear error for an unknown id or unsupported spaces."""
    env = gym_envs.make(env_id if isinstance(env_id, EnvRecipe) else gym_envs.resolve(env_id, env_module))
    try:
        return space_spec(env.observation_space, env.action_space)
    finally:
        env.close()


def envpool_spec(recipe: EnvRecipe) -> SpaceSpec:
    """The spaces of an env envpool ships, made by envpool (it may have no gymnasium twin)."""
    from raylane.actors.envpool_env import EnvpoolVectorEnv, check

    check(recipe.env_id, recipe.kwargs, recipe.wrappers)
    env = EnvpoolVectorEnv(recipe.env_id, 1, recipe.kwargs)
    try:
        return space_spec(*env.spaces())
    finally:
        env.close()


RLInputs = tuple[EnvRecipe, NetConfig, SpaceSpec]
"""What :func:`resolve` checked (the RL jobs' prepare), handed to the workload."""


def resolve(c: RLEnvConfig) -> RLInputs:
    """The env recipe, the network and the spaces the config means, each tried here (an
    env made and wrapped, the user's network run on a batch) before any actor starts."""
    make_id = c.make_id
    portable = gym_envs.portable_spec(make_id) if c.vector != "envpool" else None  # a user's env class, by value
    recipe = EnvRecipe(make_id, dict(c.env_kwargs), gym_envs.load_wrappers(c.wrappers), tuple(c.wrappers), portable)
    spec = check_env(recipe) if c.vector != "envpool" else envpool_spec(recipe)
    if c.policy is None:
        return recipe, NetConfig(tuple(c.hidden), c.activation), spec
    changed = [k for k, v in (("hidden", c.hidden != [64, 64]), ("activation", c.activation != "tanh")) if v]
    if changed:
        raise ValueError(f"policy={c.policy!r} builds the whole network, so {' and '.join(changed)} would be ignored; "
                         "drop them or let your factory read its own settings")
    try:
        factory = imports.load_callable(c.policy, "policy", "factory(spec) -> nn.Module")
    except imports.ImportPathError as exc:
        raise PolicyFactoryError(str(exc)) from None
    net = NetConfig(tuple(c.hidden), c.activation, factory, c.policy)
    check_factory(spec, net)
    return recipe, net, spec


def check_budget(job: str, c: Any, spec: SpaceSpec, *, steps: int, steps_key: str,
                 driver: tuple[int, str, tuple[str, ...]], learner: tuple[int, str, tuple[str, ...]]) -> None:
    """Refuse an RL job whose fragments would take far too long to sample, or whose env
    copies and samples would not fit a worker, the learner or the driver. ``driver`` and
    ``learner``: how many fragments each holds at most, that count as a formula, and its keys.

    A sample is 8 x obs_dim bytes (the observation, and the raw one when normalising) + 12 x
    act_dim (the policy's float64 noise, kept as float32) + 26 (action, log-prob, value,
    reward, final value, two flags). A worker holds envs_per_worker copies and two fragments
    (the one it builds and the one returned through the object store)."""
    envs, per_fragment = c.envs_per_worker, steps * c.envs_per_worker
    budget.check_count(job, "samples per worker per fragment", per_fragment, MAX_FRAGMENT_SAMPLES,
                       f"{steps_key} ({steps}) x envs_per_worker ({envs:,})", ["envs_per_worker", steps_key],
                       f"at ~{STEP_S * 1e6:.0f} us an env step that is ~{per_fragment * STEP_S:,.0f} s of stepping per fragment; "
                       f"the bound keeps it near {MAX_FRAGMENT_SAMPLES * STEP_S:.0f} s")
    sample = 8 * spec.obs_dim + 12 * spec.act_dim + 26
    fragment = per_fragment * sample
    copy = ASYNC_COPY_BYTES if c.vector == "async" else ENV_COPY_BYTES
    frag_what = f"{steps_key} ({steps}) x envs_per_worker ({envs:,}) x {sample} bytes a sample"
    frag_keys = ("envs_per_worker", steps_key)
    budget.check(job, [Estimate(f"env copies: envs_per_worker ({envs:,}) x {budget.size(copy)} (vector={c.vector})", envs * copy, "envs_per_worker"),
                       Estimate(f"two fragments: 2 x {frag_what}", 2 * fragment, frag_keys)], where="rollout worker")
    for where, (count, formula, keys) in (("learner", learner), ("driver", driver)):
        budget.check(job, [Estimate(f"fragments: {formula} x {frag_what}", count * fragment, frag_keys + keys)], where=where)


def export_policy(conf: Any, state: dict, folder: Any) -> dict[str, Any]:
    """``JobSpec.export`` of ppo and impala (:func:`raylane.actors.policy_export.export`),
    the run's config describing the network of a checkpoint written before the learner's
    state did (its env made, its factory imported)."""
    from raylane.actors import policy_export

    def described() -> dict[str, Any]:
        _, net, spec = resolve(conf)
        return policy_export.describe(spec, net, bool(getattr(conf, "normalize_obs", False)))

    return policy_export.export(conf, state, folder, described if conf is not None else None)
