"""What the run does when a node joins, gets a preemption notice or is lost, between steps.

Stateless actors on a node under notice move at once; actors on a lost node are evicted
(their pools start replacements); the workload hears of each event (``on_event``); pools
are rescaled when capacity changed; and a checkpoint is asked for while stateful actors
still sit on a node that is leaving, so its loss costs at most the step under way. Every
actor that left a group is an ``eviction`` event with its node and cause.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from raylane.cluster import ClusterView
from raylane.elastic import Elasticity
from raylane.group import Groups
from raylane.preemption import NodeJoined, NodeLeaving, NodeLost
from raylane.runlog import RunLog

log = logging.getLogger(__name__)

# A node under notice is treated as leaving until it is lost, or this long after its
# deadline (or after the notice, when it gave none).
LEAVING_GRACE_S = 120.0


class NodeReactions:
    """The reactions of one run; :meth:`react` runs between steps."""

    def __init__(self, monitor: Any, groups: Groups, workload: Any, runlog: RunLog, elastic: Elasticity,
                 refresh_cluster: Callable[[], ClusterView], since: float):
        self.monitor, self.groups, self.workload, self.log, self.elastic = monitor, groups, workload, runlog, elastic
        self._refresh = refresh_cluster
        self._leaving: dict[str, float] = {}  # node id -> deadline of its preemption notice
        self._evictions_seen: dict[str, float] = {}  # role -> time of the last eviction logged
        self._since = since

    def react(self, step: int) -> bool:
        """Handle the node events since the last call and log evictions; True when a
        checkpoint is due now (a node with stateful actors got a notice, or such actors are
        still on a node that is leaving)."""
        notice = self._events() if self.monitor is not None else False
        self._log_evictions(step)
        return notice or self._stateful_on_leaving()

    def _events(self) -> bool:
        events = self.monitor.poll()
        if not events:
            return False
        pools, stateful = self.groups.all(), self.groups.stateful()
        notice = False
        for ev in events:
            self.log.event(type(ev).__name__, node=ev.node_id, market=ev.market, deadline=getattr(ev, "deadline", None))
            if isinstance(ev, NodeLeaving):  # stateless actors move now; stateful ones are the workload's (on_event)
                self._leaving[ev.node_id] = ev.deadline if ev.deadline is not None else time.time()
                for name, pool in pools.items():
                    if name not in stateful and pool.status().nodes.get(ev.node_id, 0):
                        pool.evacuate(ev.node_id, "preemption notice")
            if isinstance(ev, NodeLost):
                self._leaving.pop(ev.node_id, None)
                for pool in pools.values():
                    if pool.status().nodes.get(ev.node_id, 0):
                        pool.evacuate(ev.node_id, "node lost")
            try:
                notice = bool(self.workload.on_event(ev)) or notice
            except Exception as exc:  # noqa: BLE001 - a reaction that failed must not drop the other events
                log.warning("workload's on_event(%s) failed: %s", type(ev).__name__, exc)
                self.log.event("on_event_failed", node=ev.node_id, error=str(exc)[:500])
                notice = True
            if isinstance(ev, NodeLeaving) and any(g.status().nodes.get(ev.node_id, 0) for g in stateful.values()):
                notice = True  # stateful actors the workload did not move: checkpoint now; they are replaced on recovery
        self._refresh()
        if any(isinstance(e, (NodeJoined, NodeLost)) for e in events):
            self.elastic.rescale(pools)
        return notice

    def _log_evictions(self, step: int) -> None:
        """Every actor that left a group since the last step is an event with its node and
        cause (a lost rollout worker or sampler costs only time, but it must be visible)."""
        for role, pool in self.groups.all().items():
            seen = self._evictions_seen.get(role, self._since)
            for e in pool.status().evictions:
                if e.at > seen:
                    self.log.event("eviction", role=role, actor=e.actor, node=e.node_id, reason=e.reason, at=e.at, step=step)
                    self._evictions_seen[role] = max(self._evictions_seen.get(role, seen), e.at)

    def _stateful_on_leaving(self) -> bool:
        """Stateful actors still on a node under notice (the workload did not hand their
        state over): checkpoint after every step until the node is gone."""
        now = time.time()
        for node, deadline in list(self._leaving.items()):
            if now > deadline + LEAVING_GRACE_S:  # the node outlived its notice by far: stop treating it as leaving
                del self._leaving[node]
        if not self._leaving:
            return False
        return any(g.status().nodes.get(node, 0) for g in self.groups.stateful().values() for node in self._leaving)
