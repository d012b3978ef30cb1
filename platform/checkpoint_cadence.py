"""When a run checkpoints, and the checkpointing itself: every N steps, every T seconds, at
once on a preemption notice for a node with stateful actors, at the end, and on demand
(the initial state, a stop request). The policy is pure; :class:`Checkpointer` applies it
to the run's store and says what it wrote.

A state holding :class:`~raylane.checkpoint_parts.Part` snapshots is persisted by the
actors themselves while the next steps run, and committed (the driver's state and the
manifest) at the first step boundary after every part is written; one checkpoint is in
flight at a time. A checkpoint asked for at a notice, a stop or the end is waited for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from raylane.checkpoint import CheckpointInfo, CheckpointStore, part_dir
from raylane.checkpoint_format import PartRef
from raylane.checkpoint_parts import Part
from raylane.cluster import ClusterView
from raylane.replicas import InMemory, Keepers
from raylane.replicas import replicate as replicate_cut
from raylane.replicas import sources as replica_sources
from raylane.runlog import RunLog, say
from raylane.workload import DriverError


@dataclass(frozen=True)
class CheckpointStatus:
    step: int
    last_step: int | None
    last_time: float
    now: float
    notice: bool = False  # a node holding stateful actors got a preemption notice
    final: bool = False


SAVE_WAIT_S = 10.0
"""How long a checkpoint step waits for the previous cut's copies to reach their keepers
before it sends its own cut (a plain step does not wait: it skips its cut)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every N steps, every T seconds, at once on a preemption notice, and at the end."""

    every_steps: int = 10
    """Steps between checkpoints; 0 turns step-based checkpoints off."""
    every_s: float = 0.0
    """Seconds between checkpoints; 0 turns time-based checkpoints off."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or not (self.every_s >= 0 and math.isfinite(self.every_s)):
            raise ValueError(f"every_steps and every_s must be >= 0, got {self.every_steps}, {self.every_s}")

    def decide(self, s: CheckpointStatus) -> tuple[bool, str]:
        if s.last_step == s.step:
            return False, "already saved at this step"
        if s.notice:
            return True, "preemption notice for a node with stateful actors"
        if s.final:
            return True, "run finished"
        if self.every_steps and s.step % self.every_steps == 0:
            return True, f"every {self.every_steps} steps"
        if self.every_s and s.now - s.last_time >= self.every_s:
            return True, f"{s.now - s.last_time:.0f} s since the last checkpoint"
        return False, ""


@dataclass
class _InFlight:
    """A checkpoint whose parts the actors are writing."""

    step: int
    state: dict
    refs: dict[str, Any]  # part name -> ObjectRef of its files
    reason: str
    started: float
    stall_s: float
    nbytes: int
    deadline: float = field(default=0.0)


def _swap_parts(obj: Any, fn: Callable[[str, Part], Any], path: tuple = ()) -> Any:
    """``obj`` with every :class:`Part` replaced by ``fn(name, part)`` (name: its path, dotted)."""
    if isinstance(obj, Part):
        return fn(".".join(str(p) for p in path), obj)
    if isinstance(obj, dict):
        return {k: _swap_parts(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap_parts(v, fn, path + (i,)) for i, v in enumerate(obj))
    return obj


class Checkpointer:
    """One run's checkpoints: the policy applied to its store, with an event per checkpoint."""

    def __init__(self, store: CheckpointStore, policy: CheckpointPolicy, runlog: RunLog, timeout_s: float = 600.0):
        """``timeout_s``: how long the actors may take to write their parts of one checkpoint."""
        self.store, self.policy, self.log, self.timeout_s = store, policy, runlog, timeout_s
        self.last_step: int | None = None
        self.last_time = time.time()
        self.written = 0
        self.newest_written: tuple[int, str] | None = None
        self.in_flight: _InFlight | None = None
        self._via_driver_said = False
        self.replicate_every = 0
        self.keepers: Keepers | None = None
        self.memory: InMemory | None = None  # the newest cut replicated to keepers (copies may be on their way)
        self.memory_before: InMemory | None = None  # the cut before it: restored when a copy of the newest was cut off
        self.uses_parts = False  # the workload's state has parts (seen at its first checkpoint)
        self.replicas_deferred = 0  # steps not replicated since the last checkpoint event: the newest cut's copies were still travelling
        self._deferred_said = False
        self.on_commit: Callable[[CheckpointInfo], None] | None = None  # called with every checkpoint committed

    def replicate(self, every_steps: int, cluster: Callable[[], ClusterView]) -> None:
        """Keep a replica of every part's snapshot in a keeper's memory every ``every_steps``
        steps (for a workload whose state has parts), restored from before the store."""
        self.replicate_every = every_steps
        self.keepers = Keepers(cluster, lambda msg: (say(msg), self.log.event("replica_alone", reason=msg)))

    def maybe(self, step: int, state: Callable[[], dict[str, Any]], *, notice: bool = False, final: bool = False, force: str = "",
              soon: str = "") -> CheckpointInfo | None:
        """Write ``state()`` as checkpoint ``step`` when the policy (or ``force``, the reason)
        says so, or ``soon`` (a reason too) asks for it without waiting for the parts to be
        written; a checkpoint in flight is committed first once its parts are written. Between
        checkpoints, a workload with parts is snapshotted and replicated to keepers every
        ``replicate_every`` steps."""
        self.settle(wait=notice or final or bool(force))  # a notice, a stop, the end: nothing left in flight
        status = CheckpointStatus(step, self.last_step, self.last_time, time.time(), notice=notice, final=final)
        save, why = (True, force) if force else self.policy.decide(status)
        if not save and soon and self.last_step != step:
            save, why = True, soon
        wants_cut = self.keepers is not None and (self.memory is None or self.memory.step != step)
        due = wants_cut and self.uses_parts and self.replicate_every > 0 and step % self.replicate_every == 0
        replicate = due and self._copies_landed()
        if not save and not replicate:
            if due:
                self._deferred(step)
            return None
        if save:
            self.settle(wait=True)  # one in flight at a time
        t0 = time.time()
        whole = state()
        parts: dict[str, Part] = {}
        whole = _swap_parts(whole, lambda name, part: (parts.setdefault(name, part), PartRef(name))[1])
        if parts:
            self.uses_parts = True
            # A checkpoint's snapshot is replicated too, waiting (bounded) for the copies before
            # it to land, so the newest checkpoint always has its cut in memory (not on a notice
            # or at the end: the notice's seconds go to the store, and no restore follows the end).
            if wants_cut and (replicate or self._copies_landed(wait_s=0.0 if notice or final else SAVE_WAIT_S)):
                self.memory_before, self.memory = self.memory, replicate_cut(step, whole, parts, self.keepers)
            elif wants_cut:
                self._deferred(step)
        if not save:
            return None
        self.loaded(step)
        if not parts:
            info = self.store.save(step, whole)
            self._committed(info, why, time.time() - t0, {})
            return info
        stall = time.time() - t0
        if self.store.local and (far := sorted({p.node_ip for p in parts.values()} - {ray.util.get_node_ip_address()})):
            # Actors on other hosts cannot write into this host's folder: their snapshots come
            # through the driver (a shared filesystem or an object store as driver.checkpoint_uri avoids that).
            if not self._via_driver_said:
                self._via_driver_said = True
                why = f"{self.store.uri} is a local folder of the driver's host"
                say(f"checkpoint parts of actors on {', '.join(far)} go through the driver: {why}; put driver.checkpoint_uri on shared storage or an object store to spare it")
                self.log.event("checkpoint_parts_via_driver", hosts=far, reason=why)
            snaps = {n: p.handle.take_snapshot.remote(p.token) for n, p in parts.items()}
            got = dict(zip(snaps, ray.get(list(snaps.values()), timeout=self.timeout_s)))
            info = self.store.save(step, _fill_refs(whole, got))
            self._committed(info, why, time.time() - t0, {})
            return info
        self.store.clear(step)
        refs = {}
        for n, p in parts.items():
            p.handle.persist_part.remote(self.store.uri, part_dir(self.store.root, step, n), p.token)
            refs[n] = p.handle.part_written.remote(p.token, self.timeout_s)
        self.in_flight = _InFlight(step, whole, refs, why, t0, stall, sum(p.nbytes for p in parts.values()), t0 + self.timeout_s)
        if notice or final or force:
            return self.settle(wait=True)
        return None

    def _deferred(self, step: int) -> None:
        """Step ``step`` was not replicated (the newest cut's copies were still travelling):
        counted for the next checkpoint event, and said once per run, on the terminal and in
        a ``replicas_deferred`` event, since the run then replicates less often than
        ``driver.replicate_every_steps`` asks."""
        self.replicas_deferred += 1
        if not self._deferred_said:
            self._deferred_said = True
            msg = (f"replication: the copies of step {self.memory.step if self.memory else '?'} had not reached their keepers by step {step}, "
                   f"so steps are replicated as the copies land rather than every driver.replicate_every_steps={self.replicate_every} "
                   "(said once; each checkpoint event counts the steps skipped as replicas_deferred)")
            say(msg)
            self.log.event("replicas_deferred", step=step, reason=msg)

    def _copies_landed(self, wait_s: float = 0.0) -> bool:
        """Whether every copy of the newest cut has reached its keeper (or failed on the way).
        A new cut is sent only then: copies never queue up behind a slow keeper or link
        (where each queued copy's only source is its owner, so one lost node would take
        several cuts with it), and the cut before the newest is always whole in the keepers'
        memory. A step that finds copies still travelling (after ``wait_s``) is not replicated
        (counted in the next checkpoint event as ``replicas_deferred``)."""
        holds = list(self.memory.holds.values()) if self.memory is not None else []
        if not holds:
            return True
        _, rest = ray.wait(holds, num_returns=len(holds), timeout=wait_s, fetch_local=False)
        return not rest

    def settle(self, wait: bool) -> CheckpointInfo | None:
        """Commit the checkpoint in flight if its parts are written (``wait``: waiting for
        them, up to the deadline); a part that failed or ran late drops it, said in an event."""
        f = self.in_flight
        if f is None:
            return None
        refs = list(f.refs.values())
        _, rest = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, f.deadline - time.time()) if wait else 0)
        if rest and not wait:
            return None
        self.in_flight = None
        if rest:
            self.log.event("checkpoint_dropped", step=f.step, reason=f"{len(rest)} of {len(refs)} parts not written within {self.timeout_s:g} s")
            return None
        try:
            files = dict(zip(f.refs, ray.get(refs, timeout=max(1.0, f.deadline - time.time()))))
        except Exception as exc:  # noqa: BLE001 - an actor lost while writing: the previous checkpoint stays the newest
            self.log.event("checkpoint_dropped", step=f.step, reason=f"a part was not written: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        info = self.store.save(f.step, f.state, parts=files)
        self._committed(info, f.reason, f.stall_s, files, persist_s=time.time() - f.started, nbytes=f.nbytes)
        return info

    def _committed(self, info: CheckpointInfo, why: str, seconds: float, parts: dict, **more: Any) -> None:
        self.written += 1
        self.newest_written = (info.step, info.path)
        extra = {"parts": len(parts), **more} if parts else {}
        if self.replicas_deferred:
            extra["replicas_deferred"], self.replicas_deferred = self.replicas_deferred, 0
        self.log.event("checkpoint", step=info.step, reason=why, seconds=seconds, **extra)
        if self.on_commit is not None:
            self.on_commit(info)

    def loaded(self, step: int) -> None:
        """The run's state is checkpoint ``step`` now (written, or loaded on resume and recovery)."""
        self.last_step, self.last_time = step, time.time()
        # Cuts past it belong to the steps a restore threw away: never restored from.
        if self.memory_before is not None and self.memory_before.step > step:
            self.memory_before = None
        if self.memory is not None and self.memory.step > step:
            self.memory = None

    def newest(self) -> tuple[Any, dict | None, list[str]]:
        """The newest checkpoint that loads (one in flight is committed or dropped first);
        each one skipped on the way is an event. The replicated cut in memory comes first
        when it is as new as the store's newest and every part has its owner's snapshot or
        its keeper's copy; the ``restore_source`` event says which was used."""
        self.settle(wait=True)
        latest, state, skipped = self.store.newest()
        for why in skipped:
            self.log.event("checkpoint_skipped", reason=why)
        cuts = [c for c in (self.memory, self.memory_before) if c is not None and (latest is None or c.step >= latest.step)]
        for cut in cuts:
            found = replica_sources(cut)
            if found is not None:
                refs, used = found
                self.log.event("restore_source", step=cut.step, source="memory", parts=used)
                return CheckpointInfo(cut.step, "memory", time.time(), {}), _fill_refs(cut.state, refs), skipped
        if cuts:
            self.log.event("restore_source", step=latest.step if latest else None, source="store",
                           reason=f"a part of the step-{'/'.join(str(c.step) for c in cuts)} replicas has neither its actor nor its keeper")
        elif latest is not None and self.memory is not None:
            self.log.event("restore_source", step=latest.step, source="store")
        return latest, state, skipped

    def close(self) -> None:
        """The run ends: its keepers go."""
        if self.keepers is not None:
            self.keepers.close()
        self.memory = self.memory_before = None

    def resume_point(self, resume: bool, run_name: str) -> tuple[Any, dict | None]:
        """(info, state) of the checkpoint a starting run continues from, or (None, None):
        ``resume`` off and checkpoints present is refused; none that loads starts over, said."""
        if not resume:
            if self.store.steps():
                raise DriverError(f"run {run_name!r} already has checkpoints (steps {self.store.steps()}) in {self.store.uri}; "
                                  "set driver.resume=true to continue it, or choose another run name to start over")
            return None, None
        latest, state, skipped = self.newest()
        if latest is None and skipped:
            self.log.event("resume_none", skipped=len(skipped), reason="no checkpoint of this run loads; starting from step 0")
            say(f"run {run_name!r} has no checkpoint that loads ({len(skipped)} skipped, see above); starting from step 0")
        return latest, state


def _fill_refs(obj: Any, got: dict[str, Any]) -> Any:
    """``obj`` with every :class:`PartRef` replaced by the state ``got`` holds for it."""
    if isinstance(obj, PartRef):
        return got[obj.name]
    if isinstance(obj, dict):
        return {k: _fill_refs(v, got) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_refs(v, got) for v in obj)
    return obj
