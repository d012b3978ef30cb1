"""The run's group registry and the workload contract refuse bad use early, naming what to change (no Ray)."""

from __future__ import annotations

import pytest

from raylane.driver import Driver, DriverConfig
from raylane.group import Groups
from raylane.placement import Assignment, Plan, RoleSpec
from raylane.workload import BaseWorkload

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROLE = RoleSpec("worker", {"CPU": 1.0}, min_count=1, max_count=4, want=2)
NODES = ["ab" * 28, "cd" * 28]  # node ids as Ray writes them (hex)
PLAN = Plan(tuple(Assignment("worker", i, NODES[i], "spot", {"CPU": 1.0}, "test") for i in range(2)))


def test_a_group_is_sized_and_placed_by_the_plan_not_by_the_workload():
    groups = Groups([ROLE], PLAN)
    for option in ("size", "placer"):
        with pytest.raises(TypeError, match=r"role 'worker': a group's size and placement come from the run's plan"):
            groups.task_pool("worker", object, **{option: 3})


def test_a_role_the_workload_did_not_declare_is_refused_naming_its_roles():
    with pytest.raises(ValueError, match=r"no role 'learner' in this workload's roles\(\); roles are \['worker'\]"):
        Groups([ROLE], PLAN).gang("learner", object)


def test_the_planned_placer_starts_the_first_actors_on_the_plans_nodes_then_asks_the_cluster():
    from raylane.group import planned_placer

    asked = []
    place = planned_placer(PLAN.for_role("worker"), fallback=lambda role, n, **where: asked.append(n) or [({}, "elsewhere", "spot")] * n)
    first = place(ROLE, 2, avoid=[], existing={}, reserved={})
    assert [(node, market) for _, node, market in first] == [(NODES[0], "spot"), (NODES[1], "spot")] and asked == []
    assert [opts["scheduling_strategy"].node_id for opts, _, _ in first] == NODES  # Ray is told those nodes
    again = place(ROLE, 1, avoid=[], existing={}, reserved={})  # a replacement: the cluster as it is now
    assert [node for _, node, _ in again] == ["elsewhere"] and asked == [1]


def test_a_workload_missing_members_of_the_contract_is_refused_naming_them(tmp_path):
    class Half:
        name = "half"

        def step(self, step):
            return {}

    with pytest.raises(TypeError, match=r"workload Half lacks \[.*'roles'.*'setup'.*\]: subclass raylane.api.BaseWorkload"):
        Driver(Half(), DriverConfig(runs_dir=str(tmp_path)))

    class Whole(BaseWorkload):
        def roles(self):
            return [ROLE]

        def setup(self, ctx):
            pass

        def step(self, step):
            return {"loss": 0.0}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    Driver(Whole(), DriverConfig(runs_dir=str(tmp_path)))  # every optional member comes from BaseWorkload
