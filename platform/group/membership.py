"""Who is alive: the actors of one role, kept at a target size.

A membership lives in the driver process and owns its actors (they are created with
``max_restarts=0``: the membership, not Ray, decides where a replacement goes). It starts
actors where the role's placement says they fit, evicts an actor that died (its process
killed, its node removed) and starts a replacement away from nodes that just failed,
evacuates a node that is leaving, grows and shrinks to a target, and reports its status.
This is the one place a lost actor is replaced, for stateless and stateful roles alike.

What the actors do is the business of the two kinds built on it: the task pool
(:mod:`raylane.group.taskpool`, tickets spread over interchangeable actors) and the gang
(:mod:`raylane.group.gang`, ranked actors that each hold a part of the state). They learn
of an actor that left through :meth:`Membership._left`.

No wait is unbounded: start-up has ``start_timeout_s``, every wait a deadline, and the
errors name the role, the actor, its node and what to change.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from raylane.errors import LOST, CallTimeoutError, PoolError, short_error
from raylane.placement import PlacementError, RoleSpec, place_more
from raylane.ray_options import ray_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eviction:
    """An actor that left the membership, and why."""

    at: float
    actor: str
    node_id: str
    reason: str


@dataclass(frozen=True)
class PoolStatus:
    """Plain status data for policies and the ``raylane pools`` command."""

    role: str
    target: int
    live: int
    starting: int
    nodes: dict[str, int]
    markets: dict[str, int]
    busy_fraction: float
    evictions: tuple[Eviction, ...]
    placement_error: str | None
    busy_s: float = 0.0
    """Seconds the live actors have spent in calls, summed (for utilisation over a window)."""
    alive_s: float = 0.0
    """Seconds the live actors have existed, summed."""


@dataclass
class Member:
    """One actor: where it runs, whether it is ready, and the calls it holds (task pool)."""

    key: int
    handle: Any
    node_id: str
    market: str
    created: float
    ready_ref: Any = None
    ready: bool = False
    retiring: bool = False
    ticket: int | None = None
    ref: Any = None
    call_started: float = 0.0
    queued: list = field(default_factory=list)  # (ticket, ref) sent behind the running call
    busy_s: float = 0.0
    resources: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"#{self.key}@{self.node_id[:8]}"

    def held(self) -> list[int]:
        """Tickets this actor holds: the running call, then those queued behind it."""
        return ([] if self.ticket is None else [self.ticket]) + [t for t, _ in self.queued]


Placer = Callable[..., list[tuple[dict, str, str]]]


def default_placer(role: RoleSpec, n: int, *, avoid: Sequence[str], existing: dict[str, int], reserved: dict[str, dict[str, float]]) -> list[tuple[dict, str, str]]:
    """Place ``n`` more actors on the cluster as it is now: ``(ray options, node id, market)`` each."""
    from raylane.cluster import ClusterView

    # Cached or labelled speeds only: a calibration task here would block the driver.
    picks = place_more(role, ClusterView.from_ray(calibrate=False), n, avoid=avoid, existing=existing, reserved=reserved)
    return [(ray_options(a), a.node_id, a.market) for a in picks]


class Membership:
    """The live actors of one role; see the module docstring for the contract."""

    def __init__(
        self,
        role: RoleSpec,
        actor_cls: Any,
        *,
        actor_args: Callable[[int], tuple[tuple, dict]] | None = None,
        size: int | None = None,
        placer: Placer | None = None,
        max_start_failures: int = 3,
        start_timeout_s: float = 180.0,
    ):
        """Start ``size`` actors (default: the role's ``hi``) of ``actor_cls`` (a ``ray.remote`` class).

        ``actor_args(key)`` gives each actor's constructor ``(args, kwargs)``; ``key`` is
        a number unique within the role, so replacements get fresh seeds.
        """
        self.role = role
        self._cls = actor_cls
        self._args = actor_args or (lambda key: ((), {}))
        self._placer = placer or default_placer
        self.max_start_failures = max_start_failures
        self.start_timeout_s = start_timeout_s
        self._lock = threading.RLock()
        self._keys = itertools.count()
        self._members: dict[int, Member] = {}
        self._evictions: deque[Eviction] = deque(maxlen=50)
        self._recent_dead_nodes: dict[str, float] = {}
        self._start_failures = 0
        self._last_start_error: str | None = None
        self._placement_error: str | None = None
        self._warned: tuple[str, int] | None = None  # the placement warning last logged, and its repeats since
        self._last_place_try = 0.0
        self._closed = False
        target = role.hi if size is None else size
        self._check_size(target)
        self.target = target
        self._fill()

    # ---------------------------------------------------------------- public API

    @property
    def size(self) -> int:
        """Live actors (ready or starting), not counting those being retired."""
        with self._lock:
            return sum(1 for m in self._members.values() if not m.retiring)

    def actors(self) -> list[Any]:
        """Handles of the live, ready actors."""
        with self._lock:
            return [m.handle for m in self._members.values() if m.ready and not m.retiring]

    def resize(self, n: int) -> None:
        """Set the target size. Growth starts actors now; shrinking retires actors once
        their in-flight call has finished, so no work is lost."""
        with self._lock:
            self._check_open()
            self._check_size(n)
            self.target = n
            active = [m for m in self._members.values() if not m.retiring]
            extra = len(active) - self._keep()
            if extra > 0:
                # Retire idle actors first, then spot before on-demand, newest first.
                active.sort(key=lambda m: (bool(m.held()), m.market != "spot", -m.key))
                for m in active[:extra]:
                    m.retiring = True
            self._retire_idle()
        self._fill()

    def evacuate(self, node_id: str, reason: str = "node leaving") -> int:
        """Start replacements for the actors on ``node_id`` elsewhere, then retire them
        once their in-flight call is done. Returns how many actors were on the node."""
        with self._lock:
            moving = [m for m in self._members.values() if m.node_id == node_id and not m.retiring]
            for m in moving:
                m.retiring = True
            self._recent_dead_nodes[node_id] = time.monotonic()
            self._retire_idle(reason)
        self._fill()
        return len(moving)

    def wait_for(self, n: int, timeout_s: float) -> None:
        """Block until at least ``n`` actors are ready (see :meth:`wait_ready`)."""
        self._wait(n, timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``target`` actors are ready (a gang's ready spare counts: it can take a rank); raises naming the reason if not in time."""
        self._wait(None, timeout_s)

    def refresh(self) -> None:
        """Take in actors that became ready and replace the dead, without waiting."""
        self._check_open()
        self._pump(0.0)

    def probe(self, timeout_s: float) -> list[str]:
        """Ask every live actor whether it is there; evict those that are gone (a
        replacement starts at once). Returns the names of the evicted actors. An actor
        that does not answer within ``timeout_s`` raises :class:`CallTimeoutError`: it is
        busy or stuck, which is not the same as gone."""
        with self._lock:
            self._check_open()
            refs = {m.key: m.handle.__ray_ready__.remote() for m in self._members.values() if m.ready and not m.retiring}
        gone = []
        deadline = time.monotonic() + timeout_s
        for key, ref in refs.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                m = self._members.get(key)
                raise self._named(CallTimeoutError(f"actor {m.name if m else key} of role {self.role.name!r} did not answer within {timeout_s:.1f} s")) from None
            except LOST as exc:
                m = self._members.get(key)
                gone.append(m.name if m else str(key))
                self._evict(key, f"gone: {type(exc).__name__}")
        self._fill()
        return gone

    def status(self) -> PoolStatus:
        with self._lock:
            now = time.monotonic()
            live = [m for m in self._members.values() if not m.retiring]
            nodes: dict[str, int] = {}
            markets: dict[str, int] = {}
            busy, wall = 0.0, 0.0
            for m in live:
                nodes[m.node_id] = nodes.get(m.node_id, 0) + 1
                markets[m.market] = markets.get(m.market, 0) + 1
                busy += m.busy_s + (now - m.call_started if m.ticket is not None else 0.0)
                wall += now - m.created
            return PoolStatus(
                role=self.role.name,
                target=self.target,
                live=sum(1 for m in live if m.ready),
                starting=sum(1 for m in live if not m.ready),
                nodes=nodes,
                markets=markets,
                busy_fraction=(busy / wall) if wall > 0 else 0.0,
                evictions=tuple(self._evictions),
                placement_error=self._placement_error,
                busy_s=busy,
                alive_s=wall,
            )

    def shutdown(self) -> None:
        """Kill every actor."""
        with self._lock:
            self._closed = True
            for m in self._members.values():
                ray.kill(m.handle, no_restart=True)
            self._members.clear()

    def abandon(self) -> None:
        """Give up the work of a failed step (a task pool drops its tickets); nothing to do for a group without a queue."""

    def restored(self) -> None:
        """The run has restored the group's state after a failure (a task pool of a stateful role takes calls again)."""

    # ---------------------------------------------------------------- for the kinds built on it

    def _left(self, m: Member, reason: str) -> None:
        """Called (under the lock) when ``m`` died or was evicted; its calls are the caller's business."""

    def _keep(self) -> int:
        """Actors to keep started: the target (a gang keeps its hot spares on top)."""
        return self.target

    def _watch(self) -> dict[Any, tuple[int, str]]:
        """References to wait on in :meth:`_pump`: the start-up of every actor not yet ready."""
        return {m.ready_ref: (m.key, "ready") for m in self._members.values() if not m.ready}

    def _before_wait(self) -> None:
        """Called (under the lock) in every :meth:`_pump` round before waiting."""

    def _handle(self, key: int, kind: str, ref: Any) -> None:
        if kind == "ready":
            self._handle_ready(key, ref)

    def _check_timeouts(self) -> None:
        self._check_start_timeouts()

    def _named(self, err: PoolError) -> PoolError:
        err.role = self.role.name
        return err

    # ---------------------------------------------------------------- internals

    def _pump(self, wait_s: float) -> None:
        """One round: replace, let the kind dispatch, wait a little for anything to finish, handle it."""
        if self._start_failures >= self.max_start_failures:
            raise self._named(PoolError(
                f"pool {self.role.name!r}: {self._start_failures} actors failed in their constructor or start-up calls; "
                f"last error: {self._last_start_error}"
            ))
        self._fill()
        with self._lock:
            self._retire_idle()
            self._before_wait()
            watch = self._watch()
        if not watch:
            time.sleep(min(wait_s, 0.2))
            return
        refs = list(watch)
        done, rest = ray.wait(refs, num_returns=1, timeout=max(wait_s, 0.0), fetch_local=False)
        if done and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
            done += more
        for ref in done:
            key, kind = watch[ref]
            self._handle(key, kind, ref)
        self._check_timeouts()

    def _wait(self, n: int | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                ready = sum(1 for m in self._members.values() if m.ready and not m.retiring)
            want = self.target if n is None else n
            if ready >= want:
                return
            if time.monotonic() >= deadline:
                raise self._named(CallTimeoutError(
                    f"pool {self.role.name!r}: {ready} of {want} actors ready after {timeout_s:.1f} s"
                    + (f"; placement: {self._placement_error}" if self._placement_error else "")
                    + (f"; last start error: {self._last_start_error}" if self._last_start_error else "")
                ))
            self._pump(min(0.5, max(0.01, deadline - time.monotonic())))

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.role.name!r} is shut down")

    def _check_size(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < self.role.lo or n > self.role.hi:
            raise ValueError(f"pool {self.role.name!r}: size must be an integer in {self.role.lo}..{self.role.hi}, got {n!r}")

    def _fill(self) -> None:
        """Start actors until the non-retiring count reaches the target."""
        with self._lock:
            if self._closed:
                return
            missing = self._keep() - sum(1 for m in self._members.values() if not m.retiring)
            if missing <= 0:
                self._placement_error = None
                return
            if self._placement_error and time.monotonic() - self._last_place_try < 1.0:
                return
            now = time.monotonic()
            self._last_place_try = now
            avoid = [n for n, t in self._recent_dead_nodes.items() if now - t < 30.0]
            existing: dict[str, int] = {}
            reserved: dict[str, dict[str, float]] = {}
            for m in self._members.values():
                if m.retiring:
                    continue
                existing[m.node_id] = existing.get(m.node_id, 0) + 1
                if not m.ready or now - m.created < 5.0:  # may not show in the cluster's free resources yet
                    res = reserved.setdefault(m.node_id, {})
                    for k, v in m.resources.items():
                        res[k] = res.get(k, 0.0) + v
            try:
                picks = self._placer(self.role, missing, avoid=avoid, existing=existing, reserved=reserved)
            except PlacementError as exc:
                self._placement_error = str(exc)
                self._warn_placement(str(exc))
                return
            self._placement_error = None if len(picks) == missing else f"only {len(picks)} of {missing} actors fit now"
            self._warn_placement(self._placement_error)
            for opts, node_id, market in picks:
                key = next(self._keys)
                args, kwargs = self._args(key)
                handle = self._cls.options(max_restarts=0, max_task_retries=0, **opts).remote(*args, **kwargs)
                m = Member(key, handle, node_id, market, created=time.monotonic(), resources=_resources(opts))
                m.ready_ref = handle.__ray_ready__.remote()
                self._members[key] = m

    def _warn_placement(self, message: str | None) -> None:
        """Log a placement failure once while it stays the same (placement is retried every
        second), with how often it repeated when it changes or clears; None: it cleared."""
        if self._warned is not None and self._warned[0] == message:
            self._warned = (self._warned[0], self._warned[1] + 1)
            return
        if self._warned is not None and self._warned[1]:
            log.warning("pool %s: the placement warning above repeated %d more time(s)%s", self.role.name, self._warned[1],
                        "; actors placed again" if message is None else "")
        self._warned = None if message is None else (message, 0)
        if message is not None:
            log.warning("pool %s: cannot place more actors yet (retrying every second; said once): %s", self.role.name, message)

    def _retire_idle(self, reason: str = "pool shrunk") -> None:
        for m in list(self._members.values()):
            if m.retiring and not m.held():
                ray.kill(m.handle, no_restart=True)
                del self._members[m.key]
                self._evictions.append(Eviction(time.time(), m.name, m.node_id, reason))
                self._left(m, reason)

    def _evict(self, key: int, reason: str) -> None:
        with self._lock:
            m = self._members.pop(key, None)
            if m is None:
                return
            log.warning("pool %s: evicting actor %s: %s", self.role.name, m.name, reason)
            self._evictions.append(Eviction(time.time(), m.name, m.node_id, reason))
            self._recent_dead_nodes[m.node_id] = time.monotonic()
            if not m.ready:
                self._last_start_error = reason
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._left(m, reason)

    def _handle_ready(self, key: int, ref: Any) -> None:
        try:
            ray.get(ref, timeout=self.start_timeout_s)
            failure = None
        except (RayTaskError, GetTimeoutError) + LOST as exc:  # a ready ref that times out was lost
            failure = exc
        with self._lock:
            m = self._members.get(key)
            if m is None or ref != m.ready_ref:
                return  # gone, or an older start-up reference (a call_all made while it started is the one to wait for)
            if failure is None:
                m.ready = True
                self._start_failures = 0
                return
            # Only the actor's own code failing counts towards max_start_failures (a
            # constructor that always raises must fail the role, not loop); losing a node
            # while actors start is ordinary spot weather.
            if isinstance(failure, RayTaskError) or getattr(failure, "actor_init_failed", False):
                self._start_failures += 1
            self._evict(key, f"failed while starting: {short_error(failure)}")

    def _check_start_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            for m in [m for m in self._members.values() if not m.ready and now - m.created > self.start_timeout_s]:
                self._placement_error = f"an actor on node {m.node_id[:8]} did not start within {self.start_timeout_s:g} s (its resources never freed up?)"
                self._evict(m.key, f"not started within start_timeout_s={self.start_timeout_s:g} s")


def _resources(opts: dict) -> dict[str, float]:
    res = {"CPU": float(opts.get("num_cpus", 0.0)), "GPU": float(opts.get("num_gpus", 0.0))}
    res.update(opts.get("resources", {}))
    return {k: v for k, v in res.items() if v}
