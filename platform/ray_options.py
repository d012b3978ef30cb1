"""Where a placement plan becomes Ray scheduling options: the one module between
:mod:`raylane.placement` (pure, no Ray) and Ray's ``.options(...)``."""

from __future__ import annotations

from raylane.placement import Assignment


def ray_options(assignment: Assignment, *, soft: bool = True) -> dict:
    """Ray ``.options(...)`` for one assigned actor.

    The node affinity is soft by default: if the node went away between planning and
    scheduling, Ray may place the actor elsewhere rather than leaving it pending.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    res = dict(assignment.resources)
    opts: dict = {
        "num_cpus": res.pop("CPU", 0.0),
        "num_gpus": res.pop("GPU", 0.0),
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=assignment.node_id, soft=soft),
    }
    if "memory" in res:
        opts["memory"] = res.pop("memory")
    if res:
        opts["resources"] = res
    return opts
