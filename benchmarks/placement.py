"""Placement planning time: raylane's planner against the linear scan it replaced, side by side.

Both plan the same synthetic inventory: 15 % of the nodes carry 4 or 8 GPUs, 30 %
are on-demand, speeds range from 0.5 to 3, and three roles share the actors (5 % a
stateful role that requires a GPU, 25 % a stateful CPU role, 70 % a stateless role that
prefers spot). The GPU role outgrows the on-demand GPUs, so part of it falls back to
spot. The old planner scanned every node for every actor; it is timed only up to
``--old-max-size`` nodes (it takes seconds at 1,000 nodes and grows quadratically),
and where both run, their plans must be identical. Pure Python, no Ray.

    python benchmarks/placement.py [--max-size 10000] [--old-max-size 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from typing import Callable

from raylane.cluster import ClusterView, NodeInfo
from raylane.placement import Assignment, Plan, PlacementError, RoleSpec, _fits, _fmt, _no_room, _take, plan

SIZES = [(100, 1_000), (300, 3_000), (1_000, 10_000), (3_000, 30_000), (10_000, 100_000)]


def inventory(nodes: int, actors: int, seed: int = 0) -> tuple[list[RoleSpec], ClusterView]:
    """A synthetic cluster of ``nodes`` nodes and three roles totalling ``actors`` actors."""
    rng = random.Random(seed)
    infos = []
    for _ in range(nodes):
        gpus = float(rng.choice([4, 8])) if rng.random() < 0.15 else 0.0
        cpus = float(rng.choice([16, 32, 64]))
        infos.append(
            NodeInfo(
                node_id=f"{rng.getrandbits(224):056x}",
                market="on-demand" if rng.random() < 0.3 else "spot",
                speed=rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]),
                cpus=cpus,
                gpus=gpus,
                available={"CPU": cpus, "GPU": gpus},
            )
        )
    gpu_role, cpu_role = actors * 5 // 100, actors * 25 // 100
    roles = [
        RoleSpec("learner", {"CPU": 2.0}, count=gpu_role, stateful=True, accelerator="require"),
        RoleSpec("param_shard", {"CPU": 2.0}, count=cpu_role, stateful=True),
        RoleSpec("rollout_worker", {"CPU": 1.0}, count=actors - gpu_role - cpu_role),
    ]
    return roles, ClusterView(tuple(infos), taken_at=0.0)


# --------------------------------------------------------------------------- the old planner
# The planner as it was before the heap: for every actor, a scan over every node of the
# market for the least (gpu_bonus, placed / speed, -speed, node_id) among those that fit.


def _old_needs_for(role: RoleSpec, free: dict[str, float]) -> dict[str, float] | None:
    need = dict(role.resources)
    if role.accelerator == "require" or (role.accelerator == "prefer" and free.get("GPU", 0.0) >= 1.0):
        need["GPU"] = max(need.get("GPU", 0.0), 1.0)
    return need if _fits(free, need) else None


def _old_pick(role: RoleSpec, candidates: list[NodeInfo], free: dict, placed: Counter):
    best = None
    for node in candidates:
        need = _old_needs_for(role, free[node.node_id])
        if need is None:
            continue
        gpu_bonus = 0 if (role.accelerator == "prefer" and need.get("GPU", 0) > 0) else 1
        key = (gpu_bonus, placed[node.node_id] / max(node.speed, 1e-9), -node.speed, node.node_id)
        if best is None or key < best[0]:
            best = (key, node, need)
    return None if best is None else best[1:]


def old_plan(roles: list[RoleSpec], cluster: ClusterView) -> Plan:
    usable = [n for n in cluster.nodes if n.alive and not n.draining]
    free = {n.node_id: dict(n.available) for n in usable}
    out = []
    for role in sorted(roles, key=lambda r: (not r.stateful, roles.index(r))):
        preferred = [n for n in usable if n.market == role.preferred_market]
        other = [n for n in usable if n.market != role.preferred_market]
        placed: Counter = Counter()
        for i in range(role.hi):
            pick = _old_pick(role, preferred, free, placed)
            reason = f"{'stateful' if role.stateful else 'stateless'} role prefers {role.preferred_market}"
            if pick is None:
                pick = _old_pick(role, other, free, placed)
                reason = f"fallback: {'no' if not preferred else 'no room on'} {role.preferred_market} nodes for {_fmt(role.resources)}"
            if pick is None:
                if i >= role.lo:
                    break
                raise PlacementError(_no_room(role, role.lo, i, usable, free))
            node, need = pick
            _take(free[node.node_id], need)
            placed[node.node_id] += 1
            if need.get("GPU", 0) > 0 and role.accelerator == "prefer":
                reason += "; GPU free on this node"
            out.append(Assignment(role.name, i, node.node_id, node.market, need, reason))
    return Plan(tuple(out))


# --------------------------------------------------------------------------- timing


def seconds_per_plan(planner: Callable[[list[RoleSpec], ClusterView], Plan], roles, cluster, repeats: int) -> tuple[float, Plan]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = planner(roles, cluster)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-size", type=int, default=10_000, help="largest inventory to plan, in nodes (10 actors a node)")
    ap.add_argument("--old-max-size", type=int, default=1_000, help="largest inventory the old planner is timed on, in nodes")
    ap.add_argument("--repeats", type=int, default=3, help="plans per size; the median is printed")
    args = ap.parse_args()
    print(f"{'nodes':>6} {'actors':>7} {'new s/plan':>11} {'actors/s':>10} {'old s/plan':>11} {'old/new':>8}")
    for nodes, actors in SIZES:
        if nodes > args.max_size:
            break
        roles, cluster = inventory(nodes, actors)
        new_s, new_plan = seconds_per_plan(plan, roles, cluster, args.repeats)
        old_cols = f"{'-':>11} {'-':>8}"
        if nodes <= args.old_max_size:
            # One old plan at the larger sizes: each takes seconds.
            old_s, old = seconds_per_plan(old_plan, roles, cluster, args.repeats if nodes < 1_000 else 1)
            if old.assignments != new_plan.assignments:
                raise SystemExit(f"{nodes} nodes: the old and new planners disagree")
            old_cols = f"{old_s:>11.3f} {old_s / new_s:>8.1f}"
        print(f"{nodes:>6} {actors:>7} {new_s:>11.3f} {actors / new_s:>10.0f} {old_cols}")


if __name__ == "__main__":
    main()
