"""Actor groups: who is alive (:class:`Membership`) and what they do, as a task pool of
interchangeable actors (:class:`TaskPool`) or a gang of ranked ones (:class:`Gang`).

- ``membership``: start, evict, replace (away from a node that just failed), evacuate,
  resize, readiness, status. The driver and the elasticity code touch only this.
- ``taskpool``: tickets over stateless actors: queue depth, retry or report lost,
  partial gather, results by reference (rollout workers, samplers, gradient workers).
- ``gang``: stateful ranked actors: stable ranks, a replacement takes the lost rank and
  gets its identity through ``on_join``, one gather with a deadline and a grace period
  (an elastic gang, such as pipeline stages, deals its ranks over whoever is live).
- ``registry``: the run's groups, owned by the driver: sized and started from the plan,
  re-formed on recovery, shut down at the end (a workload asks its context for them).
- what can go wrong, and what a run survives, is :mod:`raylane.errors`.
"""

from raylane.errors import LOST, CallTimeoutError, GroupLost, PoolError, WorkError, is_recoverable
from raylane.group.gang import Gang, gather_ranks
from raylane.group.membership import Eviction, Member, Membership, PoolStatus, default_placer
from raylane.group.taskpool import TaskPool
from raylane.group.registry import Groups, planned_placer

__all__ = ["LOST", "CallTimeoutError", "Eviction", "Gang", "GroupLost", "Groups", "Member", "Membership", "PoolError",
           "PoolStatus", "TaskPool", "WorkError", "default_placer", "gather_ranks", "is_recoverable", "planned_placer"]
