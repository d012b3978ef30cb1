"""raylane.placement: split_by_speed, RoleSpec validation, plan/place_one/capacity; raylane.ray_options.

Clusters are built by hand from NodeInfo; no Ray instance is started.
"""

from __future__ import annotations

import math
import random

import pytest

from raylane.cluster import ClusterView, NodeInfo
from raylane.placement import (
    ON_DEMAND,
    SPOT,
    Assignment,
    PlacementError,
    Plan,
    RoleSpec,
    _fmt,
    _needs_for,
    _no_room,
    capacity,
    place_more,
    place_one,
    plan,
    plan_when_free,
    split_by_speed,
)
from raylane.ray_options import ray_options

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def node(node_id, market=SPOT, speed=1.0, cpus=4.0, gpus=0.0, free_cpu=None, free_gpu=None, **kw) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        market=market,
        speed=speed,
        cpus=cpus,
        gpus=gpus,
        available={"CPU": cpus if free_cpu is None else free_cpu, "GPU": gpus if free_gpu is None else free_gpu},
        **kw,
    )


def view(*nodes: NodeInfo) -> ClusterView:
    return ClusterView(tuple(nodes), taken_at=0.0)


def per_node(p, role) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in p.for_role(role):
        out[a.node_id] = out.get(a.node_id, 0) + 1
    return out


# --------------------------------------------------------------------------- split_by_speed


def test_split_docstring_examples():
    assert split_by_speed(10, [1, 2, 2]) == [2, 4, 4]
    assert split_by_speed(7, [1.0, 0.0, 1.0]) == [4, 0, 3]


def test_split_simple_cases():
    assert split_by_speed(0, [1, 2]) == [0, 0]
    assert split_by_speed(5, [3]) == [5]
    assert split_by_speed(6, [1, 2]) == [2, 4]
    assert split_by_speed(3, [1, 1, 1]) == [1, 1, 1]
    # equal remainders with equal speeds: the earlier entry wins
    assert split_by_speed(1, [1, 1, 1]) == [1, 0, 0]
    assert split_by_speed(2, [1, 1, 1]) == [1, 1, 0]
    # a tie whose remainders are exact in floating point: the faster entry wins
    assert split_by_speed(2, [1, 3]) == [0, 2]
    assert split_by_speed(2, [3, 1]) == [2, 0]


def test_split_tie_goes_to_faster_entry_when_remainders_round_differently():
    # exact shares 1/3, 4/3, 1/3: all remainders are 1/3, so the one extra item goes to the faster entry
    assert split_by_speed(2, [1, 4, 1]) == [0, 2, 0]


def _random_speeds(rng: random.Random) -> list[float]:
    n = rng.randint(1, 8)
    speeds: list[float] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.2:
            speeds.append(0)
        elif kind < 0.5:
            speeds.append(rng.randint(1, 5))
        else:
            speeds.append(round(rng.uniform(0.05, 10.0), rng.randint(0, 4)) or 0.5)
    if not any(s > 0 for s in speeds):
        speeds[rng.randrange(n)] = rng.uniform(0.1, 3.0)
    return speeds


def test_split_properties_random():
    rng = random.Random(0)
    for case in range(400):
        speeds = _random_speeds(rng)
        total = rng.randint(0, 250)
        shares = split_by_speed(total, speeds)
        ctx = f"case {case}: total={total}, speeds={speeds}, shares={shares}"
        assert len(shares) == len(speeds), ctx
        assert sum(shares) == total, ctx
        assert all(isinstance(x, int) and x >= 0 for x in shares), ctx
        weight = sum(speeds)
        for s, share in zip(speeds, shares):
            exact = total * s / weight
            assert abs(share - exact) < 1, ctx
            if s == 0:
                assert share == 0, ctx
        # deterministic, and independent of the sequence type
        assert split_by_speed(total, list(speeds)) == shares, ctx
        assert split_by_speed(total, tuple(speeds)) == shares, ctx


def test_split_is_monotone_in_speed_for_random_cases():
    # a strictly faster entry never gets fewer items than a slower one
    rng = random.Random(0)
    for _ in range(200):
        speeds = _random_speeds(rng)
        total = rng.randint(0, 100)
        shares = split_by_speed(total, speeds)
        for i in range(len(speeds)):
            for j in range(len(speeds)):
                if speeds[i] > speeds[j]:
                    assert shares[i] >= shares[j], (total, speeds, shares)


def test_split_empty_list():
    with pytest.raises(ValueError, match="empty"):
        split_by_speed(3, [])


def test_split_all_zero_speeds():
    with pytest.raises(ValueError) as e:
        split_by_speed(4, [0, 0.0])
    assert "[0, 0.0]" in str(e.value)
    assert "4" in str(e.value)


def test_split_negative_speed():
    with pytest.raises(ValueError) as e:
        split_by_speed(3, [1, -2.5])
    assert "-2.5" in str(e.value)


def test_split_nan_and_inf_speed():
    with pytest.raises(ValueError) as e:
        split_by_speed(3, [1.0, float("nan")])
    assert "nan" in str(e.value)
    with pytest.raises(ValueError) as e:
        split_by_speed(3, [float("inf"), 1.0])
    assert "inf" in str(e.value)


def test_split_negative_total():
    with pytest.raises(ValueError) as e:
        split_by_speed(-3, [1, 2])
    assert "-3" in str(e.value)


# --------------------------------------------------------------------------- RoleSpec


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(count=0), "count must be >= 1, got 0"),
        (dict(count=-2), "got -2"),
        (dict(count=2, min_count=1), "not both"),
        (dict(count=2, max_count=4), "not both"),
        (dict(), "both min_count and max_count"),
        (dict(min_count=1), "both min_count and max_count"),
        (dict(max_count=3), "both min_count and max_count"),
        (dict(min_count=5, max_count=3), "min_count=5, max_count=3"),
        (dict(min_count=0, max_count=3), "min_count=0, max_count=3"),
        (dict(count=1, resources={"CPU": -1.0}), "resource CPU must be >= 0, got -1.0"),
        (dict(count=1, accelerator="maybe"), "'maybe'"),
    ],
)
def test_rolespec_validation_names_the_role(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        RoleSpec("trainer", **kwargs)
    msg = str(e.value)
    assert "'trainer'" in msg
    assert fragment in msg


def test_rolespec_empty_name():
    with pytest.raises(ValueError, match="non-empty name"):
        RoleSpec("", count=1)


def test_rolespec_bounds_and_market():
    fixed = RoleSpec("w", count=3)
    assert (fixed.lo, fixed.hi) == (3, 3)
    assert fixed.preferred_market == SPOT
    elastic = RoleSpec("w", min_count=2, max_count=7, stateful=True)
    assert (elastic.lo, elastic.hi) == (2, 7)
    assert elastic.preferred_market == ON_DEMAND


def test_placement_error_is_value_error():
    assert issubclass(PlacementError, ValueError)


# --------------------------------------------------------------------------- plan


def test_stateful_on_demand_stateless_on_spot():
    cluster = view(node("od1", ON_DEMAND, cpus=4), node("sp1", SPOT, cpus=4))
    roles = [RoleSpec("learner", count=1, stateful=True), RoleSpec("worker", count=2)]
    p = plan(roles, cluster)
    learner = p.for_role("learner")
    workers = p.for_role("worker")
    assert [(a.node_id, a.market) for a in learner] == [("od1", ON_DEMAND)]
    assert [(a.node_id, a.market) for a in workers] == [("sp1", SPOT), ("sp1", SPOT)]
    assert [a.index for a in workers] == [0, 1]
    assert learner[0].reason == "stateful role prefers on-demand"
    assert workers[0].reason == "stateless role prefers spot"
    assert dict(workers[0].resources) == {"CPU": 1.0}
    assert p.count("worker") == 2 and p.count("learner") == 1 and p.count("nobody") == 0
    assert "worker[1] -> sp1 (spot): stateless role prefers spot" in p.explain()


@pytest.mark.parametrize("reverse", [False, True])
def test_stateless_spread_over_spot_by_speed(reverse):
    nodes = [node("slow", SPOT, speed=1.0, cpus=32), node("fast", SPOT, speed=2.0, cpus=32), node("od", ON_DEMAND, cpus=32)]
    if reverse:
        nodes.reverse()
    p = plan([RoleSpec("worker", count=6)], view(*nodes))
    assert per_node(p, "worker") == {"slow": 2, "fast": 4}


def test_spread_three_nodes_matches_split_by_speed():
    nodes = [node("a", speed=1.0, cpus=64), node("b", speed=2.0, cpus=64), node("c", speed=3.0, cpus=64)]
    p = plan([RoleSpec("worker", count=12)], view(*nodes))
    assert per_node(p, "worker") == {"a": 2, "b": 4, "c": 6}
    assert split_by_speed(12, [1, 2, 3]) == [2, 4, 6]


def test_fallback_when_preferred_market_full():
    cluster = view(node("sp1", SPOT, cpus=4, free_cpu=1), node("od1", ON_DEMAND, cpus=4))
    p = plan([RoleSpec("worker", count=3)], cluster)
    ws = p.for_role("worker")
    assert [a.node_id for a in ws] == ["sp1", "od1", "od1"]
    assert ws[0].reason == "stateless role prefers spot"
    for a in ws[1:]:
        assert "fallback" in a.reason
        assert a.reason == "fallback: no room on spot nodes for CPU=1"
        assert a.market == ON_DEMAND


def test_fallback_when_preferred_market_absent():
    cluster = view(node("sp1", SPOT, cpus=4))
    p = plan([RoleSpec("learner", count=1, stateful=True, resources={"CPU": 2})], cluster)
    (a,) = p.assignments
    assert a.node_id == "sp1" and a.market == SPOT
    assert a.reason == "fallback: no on-demand nodes for CPU=2"


def test_elastic_role_takes_what_fits():
    cluster = view(node("sp1", SPOT, cpus=3), node("od1", ON_DEMAND, cpus=2))
    p = plan([RoleSpec("worker", min_count=2, max_count=10)], cluster)
    assert p.count("worker") == 5
    assert per_node(p, "worker") == {"sp1": 3, "od1": 2}


def test_elastic_role_stops_at_max():
    cluster = view(node("sp1", SPOT, cpus=16))
    p = plan([RoleSpec("worker", min_count=1, max_count=3)], cluster)
    assert p.count("worker") == 3


def test_elastic_role_below_min_raises():
    cluster = view(node("sp1", SPOT, cpus=3))
    with pytest.raises(PlacementError) as e:
        plan([RoleSpec("worker", min_count=4, max_count=8)], cluster)
    msg = str(e.value)
    assert "role 'worker' needs 4 actor(s) of {CPU=1} but only 3 fit." in msg
    assert "node sp1 (spot) free {CPU=0}" not in msg  # zero amounts are not printed
    assert "node sp1 (spot) free {nothing}, missing {CPU=1}" in msg


def test_role_that_fits_nowhere_names_role_resources_and_missing_amounts():
    cluster = view(node("sp1", SPOT, cpus=8, free_cpu=1), node("od1", ON_DEMAND, cpus=8, free_cpu=2.5))
    role = RoleSpec("param_shard", resources={"CPU": 4, "memory": 0}, count=1, stateful=True)
    with pytest.raises(PlacementError) as e:
        plan([role], cluster)
    msg = str(e.value)
    assert "role 'param_shard' needs 1 actor(s) of {CPU=4} but only 0 fit." in msg
    assert "node sp1 (spot) free {CPU=1}, missing {CPU=3}" in msg
    assert "node od1 (on-demand) free {CPU=2.5}, missing {CPU=1.5}" in msg


def test_error_for_second_actor_shows_free_after_first():
    cluster = view(node("sp1", SPOT, cpus=3))
    with pytest.raises(PlacementError) as e:
        plan([RoleSpec("w", resources={"CPU": 2}, count=2)], cluster)
    msg = str(e.value)
    assert "needs 2 actor(s) of {CPU=2} but only 1 fit." in msg
    assert "node sp1 (spot) free {CPU=1}, missing {CPU=1}" in msg


def test_draining_and_dead_nodes_never_used():
    cluster = view(
        node("drain", SPOT, speed=10.0, cpus=64, draining=True, drain_deadline=123.0),
        node("dead", SPOT, speed=10.0, cpus=64, alive=False),
        node("ok", SPOT, cpus=2),
    )
    p = plan([RoleSpec("w", count=2)], cluster)
    assert [a.node_id for a in p.assignments] == ["ok", "ok"]
    with pytest.raises(PlacementError) as e:
        plan([RoleSpec("w", count=3)], cluster)
    msg = str(e.value)
    assert "only 2 fit" in msg
    assert "node ok (spot)" in msg
    assert "drain" not in msg and "dead" not in msg


def test_no_usable_nodes_message():
    cluster = view(node("dead", SPOT, cpus=4, alive=False))
    with pytest.raises(PlacementError, match="No alive, non-draining nodes"):
        plan([RoleSpec("w", count=1)], cluster)


def test_prefer_takes_gpu_on_gpu_node_and_cpu_elsewhere():
    cluster = view(node("gpu", SPOT, speed=1.0, cpus=4, gpus=1), node("cpu", SPOT, speed=4.0, cpus=4))
    p = plan([RoleSpec("learner_ish", count=2, accelerator="prefer")], cluster)
    first, second = p.assignments
    # the free GPU wins over the faster CPU-only node
    assert first.node_id == "gpu"
    assert dict(first.resources) == {"CPU": 1.0, "GPU": 1.0}
    assert first.reason.endswith("; GPU free on this node")
    assert second.node_id == "cpu"
    assert dict(second.resources) == {"CPU": 1.0}
    assert "GPU" not in second.reason


def test_prefer_runs_on_cpu_when_no_gpu_anywhere():
    cluster = view(node("cpu", SPOT, cpus=2))
    p = plan([RoleSpec("w", count=2, accelerator="prefer")], cluster)
    assert [dict(a.resources) for a in p.assignments] == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_require_without_gpu_raises():
    cluster = view(node("cpu1", SPOT, cpus=8), node("cpu2", ON_DEMAND, cpus=8))
    with pytest.raises(PlacementError) as e:
        plan([RoleSpec("trainer", count=1, accelerator="require")], cluster)
    msg = str(e.value)
    assert "role 'trainer' needs 1 actor(s) of {CPU=1, GPU=1}" in msg
    assert "node cpu1 (spot) free {CPU=8}, missing {GPU=1}" in msg
    assert "node cpu2 (on-demand) free {CPU=8}, missing {GPU=1}" in msg


def test_require_uses_gpu_nodes():
    cluster = view(node("cpu", SPOT, cpus=8), node("gpu", SPOT, cpus=8, gpus=2))
    p = plan([RoleSpec("trainer", count=2, accelerator="require")], cluster)
    assert [(a.node_id, dict(a.resources)) for a in p.assignments] == [("gpu", {"CPU": 1.0, "GPU": 1.0})] * 2


def test_duplicate_role_names_raise():
    cluster = view(node("sp1", cpus=8))
    with pytest.raises(PlacementError, match=r"duplicates \['w'\]"):
        plan([RoleSpec("w", count=1), RoleSpec("v", count=1), RoleSpec("w", count=2)], cluster)


def test_counts_override():
    cluster = view(node("sp1", cpus=16))
    role = RoleSpec("w", min_count=1, max_count=8)
    assert plan([role], cluster).count("w") == 8
    assert plan([role], cluster, counts={"w": 3}).count("w") == 3
    with pytest.raises(PlacementError, match=r"asked for 9 actors, allowed 1\.\.8"):
        plan([role], cluster, counts={"w": 9})
    with pytest.raises(PlacementError, match=r"asked for 2 actors, allowed 4\.\.4"):
        plan([RoleSpec("f", count=4)], cluster, counts={"f": 2})
    with pytest.raises(PlacementError, match=r"unknown roles \['x'\]"):
        plan([role], cluster, counts={"x": 1})


def test_stateful_role_placed_first_even_when_listed_second():
    cluster = view(node("od1", ON_DEMAND, cpus=1), node("sp1", SPOT, cpus=1))
    roles = [RoleSpec("worker", min_count=1, max_count=2), RoleSpec("learner", count=1, stateful=True)]
    p = plan(roles, cluster)
    assert [(a.role, a.node_id) for a in p.assignments] == [("learner", "od1"), ("worker", "sp1")]


def test_plan_does_not_mutate_cluster():
    n = node("sp1", cpus=4)
    cluster = view(n)
    plan([RoleSpec("w", count=4)], cluster)
    assert dict(n.available) == {"CPU": 4.0, "GPU": 0.0}
    # a second plan on the same view sees all of the capacity again
    assert plan([RoleSpec("w", count=4)], cluster).count("w") == 4


# --------------------------------------------------------------------------- place_one


def test_place_one_picks_fastest_and_honours_avoid():
    cluster = view(node("fast", SPOT, speed=2.0), node("slow", SPOT, speed=1.0), node("od", ON_DEMAND, speed=5.0))
    role = RoleSpec("worker", min_count=2, max_count=6)
    a = place_one(role, cluster)
    assert (a.role, a.index, a.node_id) == ("worker", 0, "fast")
    assert place_one(role, cluster, avoid=["fast"]).node_id == "slow"
    b = place_one(role, cluster, avoid=("fast", "slow"))
    assert b.node_id == "od" and "fallback" in b.reason
    # avoid is soft: when every node is avoided, the best node is used anyway
    assert place_one(role, cluster, avoid=["fast", "slow", "od"]).node_id == "fast"


def test_place_one_keeps_stateful_and_accelerator():
    cluster = view(node("sp", SPOT, cpus=4, gpus=1), node("od", ON_DEMAND, cpus=4, gpus=1))
    a = place_one(RoleSpec("learner", count=3, stateful=True, accelerator="require"), cluster)
    assert a.node_id == "od"
    assert dict(a.resources) == {"CPU": 1.0, "GPU": 1.0}


# --------------------------------------------------------------------------- capacity


def test_capacity_numbers():
    cluster = view(
        node("sp", SPOT, cpus=8, free_cpu=5),
        node("od", ON_DEMAND, cpus=4),
        node("drain", SPOT, cpus=64, draining=True),
        node("dead", SPOT, cpus=64, alive=False),
    )
    assert capacity(RoleSpec("w", resources={"CPU": 2}, count=1), cluster) == 2 + 2
    assert capacity(RoleSpec("w", resources={"CPU": 0.5}, count=1), cluster) == 10 + 8
    assert capacity(RoleSpec("w", resources={"CPU": 1}, count=1), cluster) == 9
    assert capacity(RoleSpec("w", resources={"CPU": 1}, count=1, accelerator="require"), cluster) == 0


def test_capacity_with_gpus():
    cluster = view(node("g", SPOT, cpus=8, gpus=2), node("c", SPOT, cpus=3))
    assert capacity(RoleSpec("w", count=1, accelerator="require"), cluster) == 2
    # prefer: two with a GPU, then the rest on CPU
    assert capacity(RoleSpec("w", count=1, accelerator="prefer"), cluster) == 8 + 3
    assert capacity(RoleSpec("w", resources={"CPU": 1, "GPU": 0.5}, count=1), cluster) == 4


def test_capacity_of_role_reserving_nothing_is_unbounded():
    cluster = view(node("sp", cpus=1))
    assert capacity(RoleSpec("w", resources={}, count=1), cluster) == 10_000
    assert capacity(RoleSpec("w", resources={"CPU": 0}, count=1), cluster) == 10_000


# --------------------------------------------------------------------------- ray_options

NID = "ab" * 28  # Ray validates node ids as 56 hex characters


def test_ray_options_full():
    res = {"CPU": 2.0, "GPU": 1.0, "memory": 4e9, "accel": 1.0}
    a = Assignment("w", 0, NID, SPOT, res, "r")
    opts = ray_options(a)
    strategy = opts.pop("scheduling_strategy")
    assert opts == {"num_cpus": 2.0, "num_gpus": 1.0, "memory": 4e9, "resources": {"accel": 1.0}}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert strategy.node_id == NID
    assert strategy.soft is True
    # the assignment's resources are not consumed
    assert res == {"CPU": 2.0, "GPU": 1.0, "memory": 4e9, "accel": 1.0}


def test_ray_options_minimal_and_hard():
    a = Assignment("w", 3, NID, ON_DEMAND, {"CPU": 1.0}, "r")
    opts = ray_options(a, soft=False)
    assert opts["num_cpus"] == 1.0
    assert opts["num_gpus"] == 0.0
    assert "memory" not in opts and "resources" not in opts
    assert opts["scheduling_strategy"].soft is False
    assert opts["scheduling_strategy"].node_id == NID


def test_plan_to_ray_options():
    cluster = view(node(NID, SPOT, cpus=4, gpus=1))
    (a,) = plan([RoleSpec("w", count=1, accelerator="prefer")], cluster).assignments
    opts = ray_options(a)
    assert (opts["num_cpus"], opts["num_gpus"]) == (1.0, 1.0)
    assert opts["scheduling_strategy"].node_id == NID
    assert math.isclose(opts["num_cpus"] + opts["num_gpus"], 2.0)


# --------------------------------------------------------------------------- against the straightforward planner
# The planner keeps the nodes that fit in a heap. The reference below is the planner it
# replaced, a scan over every node for every actor, which is too slow for big clusters
# but easy to check by eye; both must give the same plans and the same errors.


def _ref_need(role, free):
    need = dict(role.resources)
    if role.accelerator == "require" or (role.accelerator == "prefer" and free.get("GPU", 0.0) >= 1.0):
        need["GPU"] = max(need.get("GPU", 0.0), 1.0)
    return need if all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0) else None


def _ref_pick(role, candidates, free, placed):
    best = None
    for n in candidates:
        need = _ref_need(role, free[n.node_id])
        if need is not None:
            gpu_bonus = 0 if (role.accelerator == "prefer" and need.get("GPU", 0) > 0) else 1
            key = (gpu_bonus, placed.get(n.node_id, 0) / max(n.speed, 1e-9), -n.speed, n.node_id)
            if best is None or key < best[0]:
                best = (key, n, need)
    return None if best is None else best[1:]


def _ref_assign(role, usable, free, want, lo, placed):
    preferred = [n for n in usable if n.market == role.preferred_market]
    other = [n for n in usable if n.market != role.preferred_market]
    out = []
    for i in range(want):
        pick = _ref_pick(role, preferred, free, placed)
        reason = f"{'stateful' if role.stateful else 'stateless'} role prefers {role.preferred_market}"
        if pick is None:
            pick = _ref_pick(role, other, free, placed)
            reason = f"fallback: {'no' if not preferred else 'no room on'} {role.preferred_market} nodes for {_fmt(role.resources)}"
        if pick is None:
            if i >= lo:
                break
            raise PlacementError(_no_room(role, lo, i, usable, free))
        n, need = pick
        for k, v in need.items():
            free[n.node_id][k] = free[n.node_id].get(k, 0.0) - v
        placed[n.node_id] = placed.get(n.node_id, 0) + 1
        if role.accelerator == "prefer" and need.get("GPU", 0) > 0:
            reason += "; GPU free on this node"
        out.append(Assignment(role.name, i, n.node_id, n.market, need, reason))
    return out


def reference_plan(roles, cluster, counts=None):
    usable = [n for n in cluster.nodes if n.alive and not n.draining]
    free = {n.node_id: dict(n.available) for n in usable}
    out = []
    for role in sorted(roles, key=lambda r: (not r.stateful, roles.index(r))):
        out += _ref_assign(role, usable, free, (counts or {}).get(role.name, role.hi), role.lo, {})
    return out


def reference_place_more(role, cluster, n, avoid, existing, reserved):
    usable = [x for x in cluster.nodes if x.alive and not x.draining]
    preferred = [x for x in usable if x.node_id not in avoid]
    for nodes in (preferred, usable):
        free = {x.node_id: dict(x.available) for x in nodes}
        for nid, res in reserved.items():
            for k, v in res.items():
                if nid in free:
                    free[nid][k] = free[nid].get(k, 0.0) - v
        try:
            return _ref_assign(role, nodes, free, n, 1, dict(existing))
        except PlacementError:
            if nodes is usable or len(preferred) == len(usable):
                raise


def outcome(fn):
    """The assignments, or the error message: what the planner and the reference must agree on."""
    try:
        out = fn()
    except PlacementError as exc:
        return str(exc)
    out = out.assignments if hasattr(out, "assignments") else out
    return [(a.role, a.index, a.node_id, a.market, list(a.resources.items()), a.reason) for a in out]


def random_inventory(rng: random.Random, n_nodes: int, n_actors: int, *, exact: bool = False) -> tuple[list[RoleSpec], ClusterView]:
    """Mixed markets and speeds, some GPUs, partly used nodes, a few dead or draining ones,
    and three roles: one stateful that needs (or prefers) a GPU, one stateful on CPUs,
    one stateless. ``exact`` keeps every amount a whole number (no rounding anywhere)."""
    nodes = []
    for i in range(n_nodes):
        cpus = float(rng.choice([8, 16, 32, 64] if exact else [1, 2, 3.5, 4, 16]))
        gpus = float(rng.choice([0, 0, 0, 0, 4] if exact else [0, 0, 0, 1, 2, 8]))
        used = rng.choice([0, 0, 1, 2] if exact else [0, 0, 0.5, 1 / 3, rng.uniform(0, cpus)])
        speed = rng.choice([0.5, 1.0, 1.0, 2.0, 3.0, 1 / 3, round(rng.uniform(0.1, 4.0), 3)])
        nodes.append(
            node(
                f"{rng.getrandbits(16):04x}{i:05d}",  # random order, never equal
                ON_DEMAND if rng.random() < 0.35 else SPOT,
                speed=speed,
                cpus=cpus,
                gpus=gpus,
                free_cpu=max(cpus - used, 0.0),
                free_gpu=gpus if exact or rng.random() < 0.7 else max(gpus - 1, 0.0),
                alive=rng.random() > 0.03,
                draining=rng.random() < 0.03,
            )
        )
    cpu = (lambda: 1.0) if exact else (lambda: rng.choice([1.0, 0.5, 2.0, 0.25, 1 / 3]))

    def sized(share: float) -> dict:
        n = max(1, int(n_actors * share))
        return {"count": n} if rng.random() < 0.5 else {"min_count": max(1, n // 2), "max_count": n}

    roles = [
        RoleSpec("learner", {"CPU": cpu()}, stateful=True, accelerator="require" if exact or rng.random() < 0.7 else "prefer", **sized(0.05)),
        RoleSpec("param_shard", {"CPU": 2 * cpu()}, stateful=True, **sized(0.25)),
        RoleSpec("rollout_worker", {"CPU": cpu()}, **sized(0.7)),
    ]
    rng.shuffle(roles)
    return roles, ClusterView(tuple(nodes), taken_at=0.0)


def test_plan_matches_reference_on_random_inventories():
    rng = random.Random(7)
    agreed = {"plans": 0, "errors": 0}
    for case in range(300):
        roles, cluster = random_inventory(rng, rng.randint(1, 30), rng.randint(1, 120))
        counts = {r.name: rng.randint(r.lo, r.hi) for r in roles if rng.random() < 0.3}
        got = outcome(lambda: plan(roles, cluster, counts))
        assert got == outcome(lambda: reference_plan(roles, cluster, counts)), f"case {case}"
        agreed["plans" if isinstance(got, list) else "errors"] += 1
    assert agreed["plans"] > 100 and agreed["errors"] > 10, agreed  # both paths were exercised


def test_place_more_matches_reference_on_random_inventories():
    rng = random.Random(11)
    for case in range(300):
        roles, cluster = random_inventory(rng, rng.randint(1, 20), 40)
        role = rng.choice(roles)
        ids = [n.node_id for n in cluster.nodes]
        avoid = rng.sample(ids, rng.randint(0, len(ids)))
        existing = {i: rng.randint(0, 5) for i in ids if rng.random() < 0.5}
        reserved = {i: {"CPU": rng.choice([0.5, 1.0])} for i in ids if rng.random() < 0.3}
        n = rng.randint(1, 30)
        got = outcome(lambda: place_more(role, cluster, n, avoid=avoid, existing=existing, reserved=reserved))
        assert got == outcome(lambda: reference_place_more(role, cluster, n, set(avoid), existing, reserved)), f"case {case}"


def test_bigger_plan_matches_reference():
    roles, cluster = random_inventory(random.Random(3), 300, 3000, exact=True)
    assert outcome(lambda: plan(roles, cluster)) == outcome(lambda: reference_plan(roles, cluster))


def _left_after(p, cluster) -> dict[str, dict[str, float]]:
    """Each usable node's free resources once the plan's actors are started, taken in plan order as the planner does."""
    free = {n.node_id: dict(n.available) for n in cluster.nodes if n.usable}
    for a in p.assignments:
        for k, v in a.resources.items():
            free[a.node_id][k] = free[a.node_id].get(k, 0.0) - v
    return free


def test_large_plan_properties():
    roles, cluster = random_inventory(random.Random(5), 2000, 20000, exact=True)
    p = plan(roles, cluster)
    nodes = {n.node_id: n for n in cluster.usable}
    left = _left_after(p, cluster)
    # every node keeps within what it had free
    assert all(v >= -1e-9 for res in left.values() for v in res.values())
    fallbacks = 0
    for role in roles:
        mine = p.for_role(role.name)
        assert [a.index for a in mine] == list(range(len(mine)))
        assert role.lo <= len(mine) <= role.hi
        assert all(a.node_id in nodes and a.market == nodes[a.node_id].market for a in mine)
        if role.accelerator == "require":
            assert all(a.resources.get("GPU", 0) >= 1 for a in mine)
        # the preferred market first; the other one only once no preferred node fits
        home = [a for a in mine if a.market == role.preferred_market]
        away = [a for a in mine if a.market != role.preferred_market]
        assert mine == home + away
        assert all(a.reason.startswith("fallback: no room on") for a in away)
        fits = {nid for nid, res in left.items() if _needs_for(role, nodes[nid], res) is not None}
        if away:
            fallbacks += 1
            assert not any(nodes[nid].market == role.preferred_market for nid in fits), role.name
        if len(mine) < role.hi:
            assert not fits, role.name  # an elastic role stops short only when nothing fits
        # in proportion to speed: no node took an actor while a node that still has room
        # was further below its share (placed / speed)
        placed = per_node(Plan(tuple(home)), role.name)
        with_room = [n for n in fits if nodes[n].market == role.preferred_market]
        if placed and with_room:
            highest_last = max((c - 1) / nodes[n].speed for n, c in placed.items())
            assert highest_last <= min(placed.get(n, 0) / nodes[n].speed for n in with_room), role.name
    assert fallbacks >= 1  # the GPU role outgrows the on-demand GPUs in this inventory
    # the order of nodes in the snapshot does not matter, and plans are repeatable
    shuffled = list(cluster.nodes)
    random.Random(1).shuffle(shuffled)
    assert plan(roles, ClusterView(tuple(shuffled), taken_at=0.0)) == p


def test_a_plan_that_holds_fewer_than_a_role_wants_is_a_shortfall_with_the_missing_resources():
    from raylane.placement import shortfalls

    view = ClusterView((NodeInfo("head", cpus=4, available={"CPU": 4.0}),))
    roles = [RoleSpec("learner", {"CPU": 1.0}, count=1, stateful=True),
             RoleSpec("rollout_worker", {"CPU": 1.0, "GPU": 0.0}, min_count=1, max_count=600, want=500)]
    the_plan = plan(roles, view)
    assert shortfalls(roles, the_plan) == [{"role": "rollout_worker", "asked": 500, "got": 3, "missing": {"CPU": 497.0}}]
    enough = [RoleSpec("rollout_worker", {"CPU": 1.0}, min_count=1, max_count=600, want=2)]
    assert shortfalls(enough, plan(enough, view)) == []


def test_want_outside_the_roles_bounds_is_refused():
    with pytest.raises(ValueError, match=r"want must be between 1 and 16, got 500"):
        RoleSpec("w", {"CPU": 1.0}, min_count=1, max_count=16, want=500)


def test_placement_imports_no_ray():
    import subprocess
    import sys

    code = "import sys, raylane.placement; assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- plan_when_free


def test_a_plan_waits_for_busy_capacity_to_free_but_not_for_capacity_the_cluster_lacks():
    """The actors of a run that just ended free their CPUs asynchronously: a new run's plan
    waits for them; a role the whole cluster cannot hold fails at once, waiting for nothing."""
    role = RoleSpec("w", {"CPU": 1.0}, count=2)
    snapshots = [view(node("a", cpus=2.0, free_cpu=0.0))] * 3 + [view(node("a", cpus=2.0))]
    reads, waits = [], []

    def read():
        reads.append(1)
        return snapshots[min(len(reads), len(snapshots)) - 1]

    cluster, p = plan_when_free([role], read, wait_s=30.0, on_wait=waits.append)
    assert len(p.for_role("w")) == 2 and len(reads) == 4 and len(waits) == 1 and "only 0 fit" in str(waits[0])
    with pytest.raises(PlacementError, match="only 0 fit"):  # busy the whole time: fails once the wait is over
        plan_when_free([role], lambda: snapshots[0], wait_s=0.5)
    too_big, calls = RoleSpec("w", {"CPU": 1.0}, count=3), []
    with pytest.raises(PlacementError):
        plan_when_free([too_big], lambda: calls.append(1) or snapshots[0], wait_s=30.0, on_wait=calls.append)
    assert len(calls) == 1  # read once, never waited
