"""Turns what Ray knows about nodes into events the driver acts on.

* :class:`NodeLeaving`: Ray is draining the node (a preemption notice or scale-down);
  ``deadline`` is when it will vanish, if the notice said.
* :class:`NodeLost`: Ray marked the node dead.
* :class:`NodeJoined`: a new node is alive.

Cloud notice pollers (spot interruption endpoints) are separate, opt-in plugins that
drain the local node through :func:`raylane.raystate.drain_node`; they are never on
in tests. The monitor itself only reads Ray's state, so it works for any source.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Union

from raylane.cluster import MARKET_LABEL


@dataclass(frozen=True)
class NodeLeaving:
    node_id: str
    market: str
    deadline: float | None

    def seconds_left(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (time.time() if now is None else now)


@dataclass(frozen=True)
class NodeLost:
    node_id: str
    market: str


@dataclass(frozen=True)
class NodeJoined:
    node_id: str
    market: str


Event = Union[NodeLeaving, NodeLost, NodeJoined]


@dataclass(frozen=True)
class NodeState:
    """The slice of a node's status that events are made from."""

    node_id: str
    market: str
    alive: bool
    draining: bool
    deadline: float | None = None


def diff(before: Iterable[NodeState], after: Iterable[NodeState]) -> list[Event]:
    """Events that turn ``before`` into ``after`` (pure; the monitor's core).

    A node seen for the first time alive is a join; one that starts draining is
    leaving; one that turns dead (or vanishes from the table) is lost.
    """
    old = {n.node_id: n for n in before}
    new = {n.node_id: n for n in after}
    events: list[Event] = []
    for nid, n in new.items():
        o = old.get(nid)
        if n.alive and o is None:
            events.append(NodeJoined(nid, n.market))
            if n.draining:
                events.append(NodeLeaving(nid, n.market, n.deadline))
        elif n.alive and n.draining and (o is None or not o.draining):
            events.append(NodeLeaving(nid, n.market, n.deadline))
        if not n.alive and o is not None and o.alive:
            events.append(NodeLost(nid, n.market))
    for nid, o in old.items():
        if nid not in new and o.alive:
            events.append(NodeLost(nid, o.market))
    return events


def current_states() -> list[NodeState]:
    from raylane import raystate

    out = []
    for raw in raystate.nodes():
        deadline = None
        if raw.draining:
            deadline = (raystate.drain_record(raw.node_id) or {}).get("deadline")
        out.append(NodeState(raw.node_id, raw.labels.get(MARKET_LABEL, "on-demand"), raw.alive, raw.draining, deadline))
    return out


class PreemptionMonitor:
    """Polls Ray's node table; each :meth:`poll` returns the events since the last one."""

    def __init__(self) -> None:
        self._last = {s.node_id: s for s in current_states()}

    def poll(self) -> list[Event]:
        states = current_states()
        events = diff(self._last.values(), states)
        self._last = {s.node_id: s for s in states}
        return events
