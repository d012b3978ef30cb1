"""Placement maths: where each role's actors go. Pure functions, no Ray.

A *role* is a group of interchangeable actors (rollout workers, samplers, parameter
shards, ...). It states what one actor needs and whether it holds state that must not
be lost. The planner assigns actors to nodes of a :class:`~raylane.cluster.ClusterView`:

* stateful roles (parameter shards, learners, trainers) prefer on-demand nodes,
* stateless roles (rollout workers, samplers) prefer spot nodes,
* a role that does not fit its preferred market falls back to the other one and the
  plan records why; a role that fits nowhere is an error naming the missing resources.

:func:`raylane.ray_options.ray_options` is the one place where a plan becomes Ray scheduling options.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

from raylane.cluster import ClusterView, NodeInfo

SPOT = "spot"
ON_DEMAND = "on-demand"
ANY = "any"
ROLE_MARKETS = ("auto", ON_DEMAND, ANY, SPOT)
MARKET_LABEL = "ray.io/market-type"


class PlacementError(ValueError):
    """A role cannot be placed; the message names the role and what is missing."""


def split_by_speed(total: int, speeds: Sequence[float]) -> list[int]:
    """Split ``total`` items into integer shares proportional to ``speeds``.

    Largest-remainder rounding: the shares sum to ``total``, each share is within 1 of
    its exact value ``total * s / sum(speeds)``, and a zero-speed entry gets 0. Ties in
    the remainder go to the faster entry, then the earlier one, so the result is
    deterministic.

    >>> split_by_speed(10, [1, 2, 2])
    [2, 4, 4]
    >>> split_by_speed(7, [1.0, 0.0, 1.0])
    [4, 0, 3]
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if len(speeds) == 0:
        raise ValueError("split_by_speed needs at least one speed, got an empty list")
    bad = [s for s in speeds if not math.isfinite(s) or s < 0]
    if bad:
        raise ValueError(f"speeds must be finite and >= 0, got {list(speeds)}")
    if sum(speeds) <= 0:
        raise ValueError(f"at least one speed must be > 0 to split {total} items, got {list(speeds)}")
    # Exact rational arithmetic: float remainders that are equal in theory can differ
    # in the last bit, which would break the documented tie rule.
    fr = [Fraction(s) for s in speeds]
    weight = sum(fr)
    exact = [total * s / weight for s in fr]
    shares = [math.floor(x) for x in exact]
    left = total - sum(shares)
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - shares[i]), -speeds[i], i))
    for i in order[:left]:
        shares[i] += 1
    return shares


@dataclass(frozen=True)
class RoleSpec:
    """What the actors of one role need and how much they matter."""

    name: str
    """Role name, unique within a job (e.g. ``rollout_worker``)."""
    resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources one actor reserves (``CPU``, ``GPU``, ``memory`` in bytes, custom)."""
    count: int | None = None
    """Fixed number of actors. Leave None and set ``min_count``/``max_count`` for an elastic role."""
    min_count: int | None = None
    """Fewest actors the job can run with (elastic roles)."""
    max_count: int | None = None
    """Most actors worth starting (elastic roles)."""
    stateful: bool = False
    """True when the actor holds state that must not be lost (prefers on-demand nodes)."""
    accelerator: Literal["none", "prefer", "require"] = "none"
    """``prefer``: take one GPU where a node has one free, else run on CPU. ``require``: GPU nodes only."""
    want: int | None = None
    """Elastic roles: how many actors the user asked to start with. A plan that holds fewer
    is reported (terminal and ``shortfall`` event) with the resources missing; None: no report."""
    market: str = "auto"
    """Where the role's actors go first: ``auto`` (stateful roles on-demand, stateless ones
    spot), ``on-demand``, ``spot`` (each falling back to the other market when it has no
    room), or ``any`` (the best node of either market). Set from ``driver.stateful_market``
    and ``driver.role_markets``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a role needs a non-empty name")
        for key, value in self.resources.items():
            if value < 0:
                raise ValueError(f"role {self.name!r}: resource {key} must be >= 0, got {value}")
        if self.count is not None:
            if self.count < 1:
                raise ValueError(f"role {self.name!r}: count must be >= 1, got {self.count}")
            if self.min_count is not None or self.max_count is not None:
                raise ValueError(f"role {self.name!r}: give either count or min_count/max_count, not both")
        else:
            lo, hi = self.min_count, self.max_count
            if lo is None or hi is None:
                raise ValueError(f"role {self.name!r}: give count, or both min_count and max_count")
            if lo < 1 or hi < lo:
                raise ValueError(f"role {self.name!r}: need 1 <= min_count <= max_count, got min_count={lo}, max_count={hi}")
        if self.want is not None and not self.lo <= self.want <= self.hi:
            raise ValueError(f"role {self.name!r}: want must be between {self.lo} and {self.hi}, got {self.want}")
        if self.market not in ROLE_MARKETS:
            raise ValueError(f"role {self.name!r}: market must be one of {', '.join(ROLE_MARKETS)}, got {self.market!r}")
        if self.accelerator not in ("none", "prefer", "require"):
            raise ValueError(f"role {self.name!r}: accelerator must be 'none', 'prefer' or 'require', got {self.accelerator!r}")

    @property
    def lo(self) -> int:
        return self.count if self.count is not None else int(self.min_count)  # type: ignore[arg-type]

    @property
    def hi(self) -> int:
        return self.count if self.count is not None else int(self.max_count)  # type: ignore[arg-type]

    @property
    def preferred_market(self) -> str:
        """``on-demand``, ``spot`` or ``any`` (see :attr:`market`)."""
        if self.market == "auto":
            return ON_DEMAND if self.stateful else SPOT
        return self.market


@dataclass(frozen=True)
class Assignment:
    """One actor of a role placed on one node, and why there."""

    role: str
    index: int
    node_id: str
    market: str
    resources: Mapping[str, float]
    reason: str


@dataclass(frozen=True)
class Plan:
    """Every role's actors assigned to nodes. ``raylane.ray_options.ray_options`` turns an entry into Ray options."""

    assignments: tuple[Assignment, ...]

    def for_role(self, role: str) -> list[Assignment]:
        return [a for a in self.assignments if a.role == role]

    def count(self, role: str) -> int:
        return len(self.for_role(role))

    def explain(self) -> str:
        lines = []
        for a in self.assignments:
            lines.append(f"{a.role}[{a.index}] -> {a.node_id[:8]} ({a.market}): {a.reason}")
        return "\n".join(lines)


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    # all(free + 1e-9 >= v for every v > 0), as a plain loop: it runs once per placed actor.
    for k, v in need.items():
        if v > 0 and not free.get(k, 0.0) + 1e-9 >= v:
            return False
    return True


def _take(free: dict[str, float], need: Mapping[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _need_variants(role: RoleSpec) -> tuple[dict[str, float], dict[str, float]]:
    """What one actor of ``role`` reserves without a GPU, and with a whole one."""
    plain = dict(role.resources)
    return plain, {**plain, "GPU": max(plain.get("GPU", 0.0), 1.0)}


def _needs_for(role: RoleSpec, node: NodeInfo, free: Mapping[str, float], variants: tuple[dict[str, float], dict[str, float]] | None = None) -> dict[str, float] | None:
    """The resources one actor of ``role`` takes on ``node``, or None if it cannot go there.

    ``variants`` (from :func:`_need_variants`) saves rebuilding them per call; the dict
    returned is then one of them, so copy it before handing it out.
    """
    plain, gpu = variants or _need_variants(role)
    takes_gpu = role.accelerator == "require" or (role.accelerator == "prefer" and free.get("GPU", 0.0) >= 1.0)
    need = gpu if takes_gpu else plain
    return need if _fits(free, need) else None


class _Fitting:
    """The nodes of one market that fit one more actor of ``role``, best first.

    Placing an actor means taking, among the nodes that fit, the least key
    ``(gpu_bonus, placed / speed, -speed, node_id)``: a free GPU first for a ``prefer``
    role, then the node furthest below its speed-proportional share, then the faster
    one, then the id. Scanning every node for each actor made a plan O(nodes x actors).
    While one role is placed, a node's key and whether it fits change only when an
    actor lands on that node (nothing else touches its ``free`` and ``placed``
    entries), so a heap that re-keys just the picked node gives exactly the picks of
    the scan in O(log nodes) per actor. Keys end in the node id, which is unique, so
    the node, need and free dict after it in an entry are never compared.
    """

    def __init__(self, role: RoleSpec, nodes: Sequence[NodeInfo], free: dict[str, dict[str, float]], placed: Counter) -> None:
        self.free, self.placed, self.gpu_rule = free, placed, role.accelerator

        def with_bonus(need: dict[str, float]) -> tuple[dict[str, float], int]:
            return need, 0 if role.accelerator == "prefer" and need.get("GPU", 0) > 0 else 1

        # Worked out once per role rather than per actor, as is everything _entry can.
        plain, gpu = _need_variants(role)
        self.without_gpu, self.with_gpu = with_bonus(plain), with_bonus(gpu)
        self.heap = [e for e in map(self._entry, nodes) if e is not None]
        heapq.heapify(self.heap)

    def _entry(self, node: NodeInfo) -> tuple | None:
        """The node's heap entry for its next actor, or None when it does not fit one."""
        free = self.free[node.node_id]
        # The choice of :func:`_needs_for`, inlined: this runs once per placed actor.
        rule = self.gpu_rule
        takes_gpu = rule == "require" or (rule == "prefer" and free.get("GPU", 0.0) >= 1.0)
        need, gpu_bonus = self.with_gpu if takes_gpu else self.without_gpu
        if not _fits(free, need):
            return None
        return (gpu_bonus, self.placed[node.node_id] / max(node.speed, 1e-9), -node.speed, node.node_id, node, need, free)

    def take(self) -> tuple[NodeInfo, dict[str, float]] | None:
        """Place one actor on the best node (updating ``free`` and ``placed``); None if none fits."""
        if not self.heap:
            return None
        node, need, free = self.heap[0][4:]
        for k, v in need.items():  # _take, inlined: this runs once per placed actor
            free[k] = free.get(k, 0.0) - v
        self.placed[node.node_id] += 1
        entry = self._entry(node)
        if entry is None:
            heapq.heappop(self.heap)
        else:
            heapq.heapreplace(self.heap, entry)
        return node, dict(need)  # each assignment owns its resources dict


def _assign(role: RoleSpec, usable: Sequence[NodeInfo], free: dict[str, dict[str, float]], want: int, lo: int, placed: Counter) -> list[Assignment]:
    """Place ``want`` actors of ``role`` (at least ``lo``) into ``free``, which is updated.

    Each actor goes to the best node of the preferred market that fits (:class:`_Fitting`),
    else to the best node of the other market.
    """
    market = role.preferred_market
    preferred = [n for n in usable if market == ANY or n.market == market]
    other = [n for n in usable if market != ANY and n.market != market]
    kind = "stateful" if role.stateful else "stateless"
    prefers = f"{kind} role takes any market" if market == ANY else f"{kind} role prefers {market}" + (" (as set)" if role.market != "auto" else "")
    fallback = f"fallback: {'no' if not preferred else 'no room on'} {role.preferred_market} nodes for {_fmt(role.resources)}"
    first = _Fitting(role, preferred, free, placed)
    # Built at the first fallback, from the free resources as they are then: nothing
    # has been taken from the other market before, and once the preferred market is
    # full it stays full (free only shrinks), so later actors all go here.
    second: _Fitting | None = None
    out = []
    for i in range(want):
        pick, reason = first.take(), prefers
        if pick is None:
            second = second or _Fitting(role, other, free, placed)
            pick, reason = second.take(), fallback
        if pick is None:
            if i >= lo:
                break  # an elastic role takes what fits above its minimum
            raise PlacementError(_no_room(role, lo, i, usable, free))
        node, need = pick
        if role.accelerator == "prefer" and need.get("GPU", 0) > 0:
            reason += "; GPU free on this node"
        out.append(Assignment(role.name, i, node.node_id, node.market, need, reason))
    return out



def shortfalls(roles: Sequence[RoleSpec], the_plan: Plan) -> list[dict]:
    """Roles whose plan holds fewer actors than they want: role, asked, got, and the Ray
    resources the missing actors would need (what the cluster would have to add)."""
    out = []
    for r in roles:
        asked = r.want if r.want is not None else r.lo
        got = the_plan.count(r.name)
        if got < asked:
            missing = {k: v * (asked - got) for k, v in sorted(r.resources.items()) if v}
            out.append({"role": r.name, "asked": asked, "got": got, "missing": missing})
    return out


def plan(roles: Sequence[RoleSpec], cluster: ClusterView, counts: Mapping[str, int] | None = None) -> Plan:
    """Assign every role's actors to nodes.

    Stateful roles are placed first (they are the ones that must not land on spot
    capacity by accident). ``counts`` overrides the number of actors per role (e.g. a
    pool's current target); elastic roles otherwise get as many as fit up to
    ``max_count``. Within a market, actors spread in proportion to node speed. Draining
    and dead nodes are never used. A plan costs O((nodes + actors) x log(nodes)).

    Raises :class:`PlacementError` naming the role, what one actor needs and what each
    node has free, when fewer than the required actors fit.
    """
    names = [r.name for r in roles]
    dupes = [n for n, c in Counter(names).items() if c > 1]
    if dupes:
        raise PlacementError(f"role names must be unique, got duplicates {dupes}")
    counts = dict(counts or {})
    unknown = set(counts) - set(names)
    if unknown:
        raise PlacementError(f"counts name unknown roles {sorted(unknown)}; roles are {names}")
    usable = [n for n in cluster.nodes if n.alive and not n.draining]
    free = {n.node_id: dict(n.available) for n in usable}
    out: list[Assignment] = []
    for role in sorted(roles, key=lambda r: (not r.stateful, names.index(r.name))):
        want = counts.get(role.name, role.hi)
        if want < role.lo or want > role.hi:
            raise PlacementError(f"role {role.name!r}: asked for {want} actors, allowed {role.lo}..{role.hi}")
        out.extend(_assign(role, usable, free, want, role.lo, Counter()))
    return Plan(tuple(out))


def place_more(
    role: RoleSpec,
    cluster: ClusterView,
    n: int,
    *,
    avoid: Sequence[str] = (),
    existing: Mapping[str, int] | None = None,
    reserved: Mapping[str, Mapping[str, float]] | None = None,
) -> list[Assignment]:
    """Where ``n`` more actors of a running role should go (pools use this to replace and grow).

    ``existing`` counts the role's live actors per node, so new ones keep the spread in
    proportion to speed; ``reserved`` holds resources of actors that were started but
    may not show in the snapshot yet. Nodes in ``avoid`` (e.g. where an actor just died)
    are used only if nothing else fits. Returns as many as fit (at least one, else
    :class:`PlacementError`).
    """
    usable = [node for node in cluster.nodes if node.alive and not node.draining]
    avoided = set(avoid)
    preferred_nodes = [node for node in usable if node.node_id not in avoided]
    for nodes in (preferred_nodes, usable):
        free = {node.node_id: dict(node.available) for node in nodes}
        for nid, res in (reserved or {}).items():
            if nid in free:
                _take(free[nid], res)
        try:
            return _assign(role, nodes, free, n, 1, Counter(existing or {}))
        except PlacementError:
            if nodes is usable or len(preferred_nodes) == len(usable):
                raise
    raise AssertionError("unreachable: the pass over all usable nodes returns or raises")


def place_one(role: RoleSpec, cluster: ClusterView, avoid: Sequence[str] = ()) -> Assignment:
    """Where a single replacement actor of ``role`` should go now."""
    return place_more(role, cluster, 1, avoid=avoid)[0]


def capacity(role: RoleSpec, cluster: ClusterView) -> int:
    """How many actors of ``role`` the cluster's free resources hold right now (any market)."""
    total = 0
    variants = _need_variants(role)
    for node in cluster.nodes:
        if not node.alive or node.draining:
            continue
        free = dict(node.available)
        while (need := _needs_for(role, node, free, variants)) is not None and total < 10_000:
            if not any(v > 0 for v in need.values()):
                return 10_000  # a role that reserves nothing is never capacity-bound
            _take(free, need)
            total += 1
    return total


def fmt_res(res: Mapping[str, float]) -> str:
    """``CPU=2, GPU=1``: the nonzero resources, sorted, Ray's per-node markers left out."""
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if v and not k.startswith("node:")) or "nothing"


def _fmt(res: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if v) or "nothing"


def _no_room(role: RoleSpec, wanted: int, placed: int, nodes: Sequence[NodeInfo], free: Mapping[str, Mapping[str, float]]) -> str:
    need = dict(role.resources)
    if role.accelerator == "require":
        need["GPU"] = max(need.get("GPU", 0.0), 1.0)
    lines = [
        f"role {role.name!r} needs {wanted} actor(s) of {{{_fmt(need)}}} but only {placed} fit.",
    ]
    if not nodes:
        lines.append("No alive, non-draining nodes in the cluster.")
    for n in nodes:
        missing = {k: v - free[n.node_id].get(k, 0.0) for k, v in need.items() if free[n.node_id].get(k, 0.0) + 1e-9 < v}
        lines.append(f"  node {n.node_id[:8]} ({n.market}) free {{{_fmt(free[n.node_id])}}}, missing {{{_fmt(missing)}}}")
    lines.append("Add nodes with those resources, lower the role's per-actor resources, or lower its count.")
    return "\n".join(lines)


def plan_when_free(roles: Sequence[RoleSpec], read_cluster: Callable[[], ClusterView], wait_s: float,
                   on_wait: Callable[[PlacementError], None] = lambda exc: None, counts: Mapping[str, int] | None = None) -> tuple[ClusterView, Plan]:
    """:func:`plan` on a fresh snapshot; while the roles would fit the cluster's whole
    capacity but not what is free now, wait (up to ``wait_s``) for busy capacity to free,
    calling ``on_wait(error)`` once. Capacity the cluster does not have fails at once."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        cluster = read_cluster()
        try:
            return cluster, plan(roles, cluster, counts)
        except PlacementError as exc:
            if time.monotonic() >= deadline or not _fits_when_idle(roles, cluster, counts):
                raise
            if not waited:
                on_wait(exc)
                waited = True
        time.sleep(0.25)


def _fits_when_idle(roles: Sequence[RoleSpec], cluster: ClusterView, counts: Mapping[str, int] | None = None) -> bool:
    """Whether the roles would fit with every node's CPUs, GPUs and memory free."""
    idle = [dataclasses.replace(n, available={**n.available, "CPU": n.cpus, "GPU": n.gpus, "memory": max(n.memory, n.available.get("memory", 0.0))})
            for n in cluster.nodes]
    try:
        plan(roles, dataclasses.replace(cluster, nodes=tuple(idle)), counts)
        return True
    except PlacementError:
        return False

