"""How a rollout worker makes its environments: the env id, its keyword arguments, the
user's wrappers, and the vector-env backend that steps the copies.

Everything here is plain data plus gymnasium's own constructors, so the driver builds
one env from the same :class:`EnvRecipe` to check it before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from raylane.actors.env_errors import EnvBuildError  # noqa: F401 - raised here, and part of this module's surface

VECTOR_BACKENDS = ("sync", "async", "envpool")
"""``sync``: gymnasium's SyncVectorEnv, every copy stepped in the worker's process (best
for cheap envs: no inter-process hop). ``async``: gymnasium's AsyncVectorEnv, one
subprocess per copy (for envs whose step costs milliseconds; give the worker the CPUs).
``envpool``: envpool's C++ envs, every copy stepped in one call (only the ids envpool
ships, no wrappers; an optional extra)."""


@dataclass(frozen=True)
class EnvRecipe:
    """One env copy's making: ``gym.make(env_id, **kwargs)``, then each wrapper in order."""

    env_id: str
    """The id handed to ``gym.make`` (``module:EnvId`` when a module must be imported first)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gym.make`` (the env's own, or gymnasium's such as max_episode_steps)."""
    wrappers: tuple[Callable[[Any], Any], ...] = ()
    """Callables ``env -> env`` applied in order (gymnasium wrapper classes are such callables)."""
    wrapper_names: tuple[str, ...] = ()
    """Their import paths, for messages."""
    spec: Any = None
    """For an env of the user's own (not installed) module: its gymnasium ``EnvSpec`` with the
    entry point resolved to the env class, made instead of looking ``env_id`` up. The class
    travels to the workers by value, as a job file's classes do, so a worker (another process,
    another folder, another node) need not import the module by name."""


def build(recipe: EnvRecipe):
    """One env made from ``recipe``; :class:`EnvBuildError` names a kwarg the env refused
    or a wrapper that did not return an env."""
    import gymnasium as gym

    try:
        env = gym.make(recipe.env_id if recipe.spec is None else recipe.spec, **recipe.kwargs)
    except TypeError as exc:
        if not recipe.kwargs:
            raise
        raise EnvBuildError(f"env_id {recipe.env_id!r} refused env_kwargs {recipe.kwargs}: {exc}. Give only keyword "
                            "arguments its constructor takes (or gymnasium's, e.g. max_episode_steps)") from None
    names = recipe.wrapper_names or tuple(getattr(w, "__name__", repr(w)) for w in recipe.wrappers)
    for wrap, name in zip(recipe.wrappers, names):
        try:
            out = wrap(env)
        except Exception as exc:  # noqa: BLE001 - the user's wrapper: name it
            raise EnvBuildError(f"wrapper {name!r} failed on {recipe.env_id!r}: {type(exc).__name__}: {exc}") from None
        if not isinstance(out, gym.Env):
            raise EnvBuildError(f"wrapper {name!r} returned {type(out).__name__}, not a gymnasium Env; a wrapper is a "
                                "callable env -> env, e.g. a gymnasium.Wrapper subclass")
        env = out
    return env


def make_vector_env(recipe: EnvRecipe | str, num_envs: int, backend: str = "sync"):
    """``num_envs`` copies stepped together with SAME_STEP autoreset: an episode's last
    observation comes back in ``info["final_obs"]`` in the step that ended it, which is
    what bootstrapping a truncated episode needs."""
    import multiprocessing

    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

    if isinstance(recipe, str):
        recipe = EnvRecipe(recipe)
    if backend == "envpool":
        from raylane.actors.envpool_env import EnvpoolVectorEnv, check

        check(recipe.env_id, recipe.kwargs, recipe.wrappers)
        return EnvpoolVectorEnv(recipe.env_id, num_envs, recipe.kwargs)
    fns = [lambda: build(recipe) for _ in range(num_envs)]
    if backend == "sync":
        return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    if backend == "async":
        # Not fork: a Ray worker runs threads, and a forked copy of them can deadlock.
        # A fork server starts clean once and forks the copies from there.
        methods = multiprocessing.get_all_start_methods()
        return AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP, context="forkserver" if "forkserver" in methods else "spawn")
    raise EnvBuildError(f"vector backend {backend!r} is not one of {', '.join(VECTOR_BACKENDS)}")
