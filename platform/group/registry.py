"""The run's actor groups, owned by the driver.

A workload asks its :class:`~raylane.workload.Context` for a group
(``ctx.task_pool(role, ActorClass, ...)``, ``ctx.gang(role, ActorClass, ...)``) and keeps
the handle it gets. Everything every workload would otherwise repeat happens here: the
group is sized from the run's plan (no workload clamps a size), its first actors start on
the nodes the plan chose (the ``plan`` event is where they went), elasticity and node-event
reactions find every group in one registry, a recovery re-forms the gangs and waits for the
pools before the checkpoint is loaded, and the driver shuts every group down at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from raylane.group.gang import Gang
from raylane.group.membership import Membership, Placer, default_placer
from raylane.group.taskpool import TaskPool
from raylane.placement import Assignment, Plan, RoleSpec
from raylane.ray_options import ray_options


def planned_placer(assignments: Sequence[Assignment], fallback: Placer = default_placer) -> Placer:
    """A placer whose first call starts actors where the plan put them; every later call
    (a replacement, growth) places on the cluster as it is then, through ``fallback``."""
    planned = list(assignments)

    def place(role: RoleSpec, n: int, **where: Any) -> list[tuple[dict, str, str]]:
        picks = [(ray_options(a), a.node_id, a.market) for a in planned[:n]]
        planned.clear()
        return picks + (fallback(role, n - len(picks), **where) if n > len(picks) else [])

    return place


class Groups:
    """Every group of one run, by role name, created from the run's roles and plan."""

    def __init__(self, roles: Sequence[RoleSpec], plan: Plan, placer: Callable[[Sequence[Assignment]], Placer] = planned_placer, spares: int = 0):
        """``spares``: hot spares each gang keeps (``driver.hot_spares``)."""
        self.roles = {r.name: r for r in roles}
        self.spares = spares
        self.plan = plan
        self._placer = placer
        self._groups: dict[str, Membership] = {}

    def role(self, name: str) -> RoleSpec:
        """The workload's role ``name``, as the driver planned it."""
        if name not in self.roles:
            raise ValueError(f"no role {name!r} in this workload's roles(); roles are {sorted(self.roles)}")
        return self.roles[name]

    def task_pool(self, role: str, actor_cls: Any, **options: Any) -> TaskPool:
        """A :class:`TaskPool` of ``role`` (see its constructor for ``options``; the size is the plan's)."""
        return self._add(TaskPool, role, actor_cls, options)

    def gang(self, role: str, actor_cls: Any, **options: Any) -> Gang:
        """A :class:`Gang` of ``role`` (see its constructor for ``options``; the size is the plan's)."""
        return self._add(Gang, role, actor_cls, options)

    def _add(self, kind: type, role: str, actor_cls: Any, options: dict) -> Any:
        spec = self.role(role)
        if "size" in options or "placer" in options:
            raise TypeError(f"role {role!r}: a group's size and placement come from the run's plan; "
                            "set the role's count (or want/min_count/max_count) in roles() instead")
        old = self._groups.pop(role, None)
        if old is not None:  # the workload builds the role again (a restart of everything): the old actors go
            old.shutdown()
        if kind is Gang and "spares" not in options:
            options = {**options, "spares": self.spares}
        group = kind(spec, actor_cls, size=self.plan.count(role), placer=self._placer(self.plan.for_role(role)), **options)
        self._groups[role] = group
        return group

    def adopt(self, group: Membership) -> Membership:
        """A group built elsewhere (a membership kind of the workload's own) joins the
        registry under its role: the driver reports, resizes, re-forms and shuts it down."""
        self.role(group.role.name)
        old = self._groups.pop(group.role.name, None)
        if old is not None and old is not group:
            old.shutdown()
        self._groups[group.role.name] = group
        return group

    def all(self) -> dict[str, Membership]:
        """{role: group}, in the order they were created."""
        return dict(self._groups)

    def stateful(self) -> dict[str, Membership]:
        return {name: g for name, g in self._groups.items() if g.role.stateful}

    def lost_stateful(self) -> dict[str, list[int]]:
        """{role: ranks} of stateful gangs whose ranks no live actor holds (evicted with a
        lost node, not yet replaced: only recovery replaces them)."""
        return {name: lost for name, g in self.stateful().items() if isinstance(g, Gang) and (lost := g.missing())}

    def ready(self) -> None:
        """After the workload's setup: every group's actors started, and every rank of a fixed
        gang given out (a no-op for what the setup already waited for)."""
        for g in self._groups.values():
            if isinstance(g, Gang) and not g.elastic:
                g.form(timeout_s=g.start_timeout_s)
            else:
                g.wait_ready(timeout_s=g.start_timeout_s)

    def abandon(self) -> None:
        """A step failed: no call of it may reach an actor after the run is rolled back."""
        for g in self._groups.values():
            g.abandon()

    def reform(self) -> None:
        """After a failure: every rank of a fixed gang on a live actor (replacements join),
        and at least one live actor in every task pool (capacity may be gone; the pools
        grow back as it returns). An elastic gang is dealt again by its workload."""
        for g in self._groups.values():
            if isinstance(g, Gang):
                if not g.elastic:
                    g.form(timeout_s=g.start_timeout_s)
            else:
                g.wait_for(1, timeout_s=g.start_timeout_s)

    def restored(self) -> None:
        """The checkpoint is loaded: pools of stateful roles take calls again."""
        for g in self._groups.values():
            g.restored()

    def shutdown(self) -> None:
        """Kill every actor of every group (the end of the run, or a restart of everything)."""
        groups, self._groups = self._groups, {}
        for g in reversed(list(groups.values())):
            g.shutdown()
