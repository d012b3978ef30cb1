"""What goes wrong making an env, shared by the gymnasium backends (:mod:`raylane.actors.envs`)
and envpool's (:mod:`raylane.actors.envpool_env`), so neither imports the other for it."""


class EnvBuildError(ValueError):
    """An env that cannot be made as configured, with what to change."""
