"""Which gymnasium environment a job means, checked before any actor starts.

Environments from plugin packages (ale-py's ``ALE/...``, a user's own module) exist only
once their module is imported. gymnasium's own ``"module:EnvId"`` form imports it inside
``gym.make``, in the driver and in every rollout worker alike, so that is the id the
workers get. The checks here turn gymnasium's errors into one line that says what to do.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from typing import Any, Callable

from raylane import imports
from raylane.actors.envs import EnvBuildError, EnvRecipe, build

# Namespaces registered by well-known plugin packages: (module to import, pip package).
PLUGINS = {
    "ALE": ("ale_py", "ale-py"),
    "MiniGrid": ("minigrid", "minigrid"),
    "BabyAI": ("minigrid", "minigrid"),
    "MetaWorld": ("metaworld", "metaworld"),
}


class EnvError(ValueError):
    """An environment id that cannot be made, with what would fix it."""


def split_id(env_id: str, env_module: str | None = None) -> tuple[str | None, str]:
    """``(module, id)`` from ``"module:Id"`` or ``env_module`` plus a plain id."""
    module, sep, name = env_id.rpartition(":")
    if not sep:
        module, name = "", env_id
    if not name:
        raise EnvError(f"env_id {env_id!r} has no environment id after the ':'; write 'module:EnvId', e.g. 'ale_py:ALE/Pong-v5'")
    if module and env_module and module != env_module:
        raise EnvError(f"env_id {env_id!r} names module {module!r} but env_module is {env_module!r}; give the module once")
    return (module or env_module or None), name


def resolve(env_id: str, env_module: str | None = None) -> str:
    """The id to hand to ``gym.make`` everywhere (``module:Id`` when a module must be
    imported first); raises :class:`EnvError` naming the fix when it cannot be made."""
    import gymnasium as gym

    module, name = split_id(env_id, env_module)
    before = set(gym.registry)
    if module:
        try:
            imports.import_module(module)  # the current folder on sys.path, as for a job file or a wrapper
        except ImportError as exc:
            raise EnvError(f"env_id {env_id!r}: module {module!r} cannot be imported ({exc}). Install the package "
                           f"that provides it, or run from the folder that holds your own module.") from None
        except Exception as exc:  # noqa: BLE001 - an error inside the user's module is theirs to fix
            raise EnvError(f"env_id {env_id!r}: importing module {module!r} failed: {imports.first_line(exc)}") from None
    if name not in gym.registry:
        raise EnvError(_unknown(env_id, name, module, sorted(set(gym.registry) - before)))
    return f"{module}:{name}" if module else name


def portable_spec(make_id: str) -> Any:
    """The ``EnvSpec`` of ``make_id`` (as :func:`resolve` returned it) to hand the workers when
    its module is the user's own, not installed: its entry point resolved to the env's class
    or factory and that module shipped by value (:func:`raylane.imports.ship`), so the env
    reaches the rollout workers as a job file's classes do. None for an installed module
    (gymnasium's own envs, a plugin package): the workers import it by name."""
    import gymnasium as gym
    from gymnasium.envs.registration import load_env_creator

    module, name = split_id(make_id)
    if module is None or module not in sys.modules or imports.installed(sys.modules[module]):
        return None
    spec = gym.spec(name)
    creator = spec.entry_point if callable(spec.entry_point) else load_env_creator(spec.entry_point)
    owner = sys.modules.get(getattr(creator, "__module__", "") or "")
    if owner is not None:
        imports.ship(owner)
    return dataclasses.replace(spec, entry_point=creator)


def _unknown(env_id: str, name: str, module: str | None, added: list[str]) -> str:
    import gymnasium as gym

    namespace = name.split("/", 1)[0] if "/" in name else None
    if module:
        # ids it registered now, or when it was first imported (its entry points name it)
        ours = added or sorted(k for k, spec in gym.registry.items() if _entry_module(spec.entry_point) == module)
        if ours:
            return (f"env_id {env_id!r}: module {module!r} was imported but registers no {name!r}; "
                    f"it registers {', '.join(ours[:8])}{' ...' if len(ours) > 8 else ''}")
        return (f"env_id {env_id!r}: module {module!r} was imported but registers no environment at all; register "
                f"yours when the module is imported: gymnasium.register(id={name!r}, entry_point=YourEnv)")
    if namespace in PLUGINS and not module:
        mod, pip = PLUGINS[namespace]
        return (f"env_id {env_id!r} comes from the plugin package {pip}: `pip install {pip}`, then use "
                f"env_id '{mod}:{name}' (or set env_module={mod}) so it is imported first")
    close = difflib.get_close_matches(name, list(gym.registry), n=3, cutoff=0.6)
    hint = (f" Did you mean {', '.join(repr(c) for c in close)}?" if close
            else " `python -c \"import gymnasium; gymnasium.pprint_registry()\"` lists them; an env of a plugin "
                 "package or of your own module is written 'module:EnvId'.")
    return f"env_id {env_id!r} is not a registered gymnasium environment.{hint}"


def _entry_module(entry_point: Any) -> str | None:
    """The module an env's entry point lives in ("pkg.mod:Class" or the class itself)."""
    if isinstance(entry_point, str):
        return entry_point.split(":", 1)[0]
    return getattr(entry_point, "__module__", None)


def make(env: str | EnvRecipe):
    """One env (with its kwargs and wrappers when given a recipe); a missing optional
    dependency (box2d, MuJoCo), a kwarg the env refuses or a wrapper that fails is one
    line naming it."""
    import gymnasium as gym

    recipe = env if isinstance(env, EnvRecipe) else EnvRecipe(env)
    try:
        return build(recipe)
    except EnvBuildError as exc:
        raise EnvError(str(exc)) from None
    except gym.error.DependencyNotInstalled as exc:
        raise EnvError(f"env_id {recipe.env_id!r} needs a package that is not installed: {str(exc).strip().splitlines()[0]}") from None


def load_wrappers(paths: list[str]) -> tuple[Callable[[Any], Any], ...]:
    """The wrappers named by import path (``package.module:NAME`` or ``path/file.py:NAME``),
    each a callable; :class:`EnvError` names the one that does not import."""
    out = []
    for path in paths:
        try:
            out.append(imports.load_callable(path, "wrapper", "env -> env"))
        except imports.ImportPathError as exc:
            raise EnvError(str(exc)) from None
    return tuple(out)
