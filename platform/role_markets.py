"""A role set to spot (``driver.stateful_market``, ``driver.role_markets``) that found no
spot room is refused at the start: the user asked for the spot price."""

from __future__ import annotations

from typing import Sequence

from raylane.cluster import ClusterView
from raylane.placement import SPOT, PlacementError, Plan, RoleSpec, fmt_res


def check_spot_roles(roles: Sequence[RoleSpec], the_plan: Plan, cluster: ClusterView) -> None:
    """A role set to ``spot`` (``driver.stateful_market``, ``driver.role_markets``) of which
    not one actor found room on a spot node is refused at the start, naming what one actor
    needs and the spot nodes there are: the user asked for the spot price, and a plan that
    quietly put the state on on-demand nodes would not give it."""
    for role in roles:
        if role.market != SPOT or any(a.market == SPOT for a in the_plan.for_role(role.name)):
            continue
        spot = [n for n in cluster.nodes if n.market == SPOT and n.alive and not n.draining]
        where = ("the cluster has no spot nodes" if not spot else
                 "spot nodes: " + ", ".join(f"{n.node_id[:8]} ({n.cpus:g} CPU, {n.gpus:g} GPU)" for n in spot))
        raise PlacementError(f"role {role.name!r} is set to spot, but no spot node has room for one actor of {{{fmt_res(role.resources)}}}: "
                             f"{where}. Add spot capacity with those resources, or set driver.stateful_market (or driver.role_markets.{role.name}) "
                             "to on-demand or any")
