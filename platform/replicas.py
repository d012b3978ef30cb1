"""Peer replicas in memory: every stateful actor's newest snapshot is also held by a keeper
actor on another node (of the other market where the cluster has one), so a lost actor is
restored from memory, not from the store, and costs at most the steps since the last
replication that completed (``driver.replicate_every_steps``, default every step; a copy
is complete once it reached the keeper, a matter of the state's size over the link).

A snapshot travels from its actor to the keeper through Ray's object store (the keeper's
call takes the actor's answer as its argument): the driver never holds it. The newest
replicated cut (the driver's own small state and one snapshot per part, all of one step
boundary) is :class:`InMemory`; restoring it gives each part either its owner's own
snapshot (the owner survived) or its keeper's copy (the owner was lost). When a part has
neither (its copy was still on its way when its node went), the cut before it is tried,
from the keepers' copies (each keeps the last two). A cut is sent only once every copy of
the one before has reached its keeper (the checkpointer skips the steps in between), so
the cut before the newest is always whole in memory; the run restores from the store only
when a keeper was lost as well.

Keepers reserve no CPU (``num_cpus=0``) and hold only memory; one per node at most,
started when a snapshot first needs one there, gone with their node or at the run's end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylane.checkpoint_parts import Part
from raylane.cluster import ClusterView

log = logging.getLogger(__name__)


KEPT = 2
"""Copies a keeper holds per part: the newest, and the one before it, which is what a
restore uses when the newest copy was cut off on its way (its owner's node lost while it
travelled); the price is a second copy in the keeper's memory."""


@ray.remote(num_cpus=0, max_restarts=0)
class ReplicaKeeper:
    """Holds other actors' snapshots: {part name: [(step, state), ...]}, the last ``KEPT``
    received per part (by arrival, not step number: a run rolled back sends lower steps again)."""

    def __init__(self) -> None:
        self.held: dict[str, list[tuple[int, Any]]] = {}

    def hold(self, name: str, step: int, state: Any) -> int:
        """Keep ``state`` (resolved by Ray from the owner's answer) as part ``name`` at ``step``."""
        kept = [(s, v) for s, v in self.held.get(name, []) if s != step]
        self.held[name] = (kept + [(step, state)])[-KEPT:]
        return step

    def has(self, name: str, step: int) -> bool:
        return any(s == step for s, _ in self.held.get(name, []))

    def replica(self, name: str, step: int) -> Any:
        for s, state in self.held.get(name, []):
            if s == step:
                return state
        have = [s for s, _ in self.held.get(name, [])]
        raise KeyError(f"no replica of part {name!r} at step {step} here (held: steps {have})")

    def drop(self, names: list[str]) -> None:
        for n in names:
            self.held.pop(n, None)


@dataclass
class InMemory:
    """The newest replicated cut: the driver's state (parts as :class:`PartRef`) and, per
    part, its owner's snapshot and the keeper that holds a copy (None where none could)."""

    step: int
    state: dict
    parts: dict[str, Part]
    keepers: dict[str, Any] = field(default_factory=dict)  # part name -> keeper handle
    holds: dict[str, Any] = field(default_factory=dict)  # part name -> ObjectRef of the keeper's hold()


class Keepers:
    """The run's keeper actors, one per node at most, and the choice of a keeper for a part."""

    def __init__(self, cluster: Callable[[], ClusterView], on_alone: Callable[[str], None]):
        """``cluster``: the driver's current view; ``on_alone(message)``: said once when a
        snapshot has no other node to be copied to."""
        self.cluster, self.on_alone = cluster, on_alone
        self.by_node: dict[str, Any] = {}
        self.load: dict[str, int] = {}  # node -> bytes of snapshots assigned there this round
        self._alone_said = False

    def choose(self, parts: dict[str, Part]) -> dict[str, Any]:
        """A keeper for each part, on a usable node other than the part's own: of the other
        market first (a spot loss then never takes both), then the least loaded."""
        view = self.cluster()
        usable = {n.node_id: n for n in view.usable}
        self.by_node = {node: k for node, k in self.by_node.items() if node in usable}
        self.load = {}
        out: dict[str, Any] = {}
        for name, part in sorted(parts.items(), key=lambda kv: -kv[1].nbytes):
            own = usable.get(part.node_id)
            others = [n for n in usable.values() if n.node_id != part.node_id]
            if not others:
                if not self._alone_said:
                    self._alone_said = True
                    self.on_alone(f"part {name!r} has no other node to keep its replica on (a one-node cluster): "
                                  "a lost actor there is restored from the store")
                continue
            best = min(others, key=lambda n: (own is not None and n.market == own.market, self.load.get(n.node_id, 0), -n.speed, n.node_id))
            self.load[best.node_id] = self.load.get(best.node_id, 0) + part.nbytes
            out[name] = self._on(best.node_id)
        return out

    def _on(self, node_id: str) -> Any:
        if node_id not in self.by_node:
            self.by_node[node_id] = ReplicaKeeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote()
        return self.by_node[node_id]

    def close(self) -> None:
        for k in self.by_node.values():
            try:
                ray.kill(k)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
        self.by_node = {}


def replicate(step: int, state: dict, parts: dict[str, Part], keepers: Keepers) -> InMemory:
    """Send every part's snapshot to its keeper (in the background) and return the cut."""
    chosen = keepers.choose(parts)
    holds = {name: k.hold.remote(name, step, parts[name].handle.peek_snapshot.remote(parts[name].token)) for name, k in chosen.items()}
    return InMemory(step, state, parts, chosen, holds)


def sources(cut: InMemory, timeout_s: float = 15.0) -> tuple[dict[str, Any], dict[str, str]] | None:
    """Where each part of ``cut`` can be restored from: {name: ObjectRef of its state} and
    {name: "own" | "peer"}; None when some part has neither its owner nor its keeper."""
    owners = {n: p.handle.has_snapshot.remote(p.token) for n, p in cut.parts.items()}
    refs: dict[str, Any] = {}
    used: dict[str, str] = {}
    for name, part in cut.parts.items():
        try:
            if ray.get(owners[name], timeout=timeout_s):
                refs[name], used[name] = part.handle.peek_snapshot.remote(part.token), "own"
                continue
        except Exception:  # noqa: BLE001 - the owner is gone (or not answering): try its keeper
            pass
        hold, keeper = cut.holds.get(name), cut.keepers.get(name)
        if hold is None or keeper is None:
            return None
        try:
            ray.get(hold, timeout=timeout_s)
            if not ray.get(keeper.has.remote(name, cut.step), timeout=timeout_s):
                raise KeyError(f"the keeper holds another step of part {name!r}")
        except Exception as exc:  # noqa: BLE001 - the keeper (or the copy to it) was lost too
            log.warning("replica of part %s at step %d is not available: %s", name, cut.step, exc)
            return None
        refs[name], used[name] = keeper.replica.remote(name, cut.step), "peer"
    return refs, used
