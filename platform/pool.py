"""Elastic actor pools: the actors of one role, kept at a target size.

A pool lives in the driver process and owns its actors (they are created with
``max_restarts=0``: the pool, not Ray, decides where a replacement goes). Work is
submitted as tickets; each ticket runs on one actor at a time and its result is
recorded exactly once. When an actor dies (its process killed, its node removed) the
pool evicts it, starts a replacement on a node that fits the role now, and puts the
dead actor's in-flight tickets back in the queue (or reports them lost, for tickets
submitted with ``retry=False``). The other actors keep working throughout. An actor
holds one call at a time, or up to ``queue_depth`` (the next ones waiting in its own
queue, so it never idles for a round trip through the pool's process).

No wait is unbounded: each call has ``call_timeout_s`` and each gather a deadline,
and both raise errors that name the actor, its node and the method.

Example::

    pool = ActorPool(RoleSpec("worker", count=2), Worker, actor_args=lambda k: ((k,), {}))
    squares = pool.map("square", [1, 2, 3, 4], timeout_s=60)
    pool.call_all("set_weights", weights_ref, timeout_s=30)
    pool.resize(4)
    pool.shutdown()
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from raylane.errors import LOST, CallTimeoutError, PoolError, WorkError  # noqa: F401 - also raylane.pool's names
from raylane.placement import PlacementError, RoleSpec, place_more
from raylane.ray_options import ray_options

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Eviction:
    """An actor that left the pool, and why."""

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
class _Member:
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


@dataclass
class _Ticket:
    id: int
    method: str
    args: tuple
    kwargs: dict
    retry: bool
    attempts: int = 0
    done: bool = False
    lost: str | None = None
    result: Any = None
    ref: Any = None  # the ObjectRef the result was read from
    error: str | None = None
    actor: str | None = None


Placer = Callable[..., list[tuple[dict, str, str]]]


def default_placer(role: RoleSpec, n: int, *, avoid: Sequence[str], existing: dict[str, int], reserved: dict[str, dict[str, float]]) -> list[tuple[dict, str, str]]:
    """Place ``n`` more actors on the cluster as it is now: ``(ray options, node id, market)`` each."""
    from raylane.cluster import ClusterView

    # Cached or labelled speeds only: a calibration task here would block the pool.
    picks = place_more(role, ClusterView.from_ray(calibrate=False), n, avoid=avoid, existing=existing, reserved=reserved)
    return [(ray_options(a), a.node_id, a.market) for a in picks]


class ActorPool:
    """The actors of one role; see the module docstring for the contract."""

    def __init__(
        self,
        role: RoleSpec,
        actor_cls: Any,
        *,
        actor_args: Callable[[int], tuple[tuple, dict]] | None = None,
        size: int | None = None,
        placer: Placer | None = None,
        call_timeout_s: float = 300.0,
        on_timeout: str = "raise",
        max_attempts: int = 3,
        max_start_failures: int = 3,
        start_timeout_s: float = 180.0,
        queue_depth: int = 1,
    ):
        """Start ``size`` actors (default: the role's ``hi``) of ``actor_cls`` (a ``ray.remote`` class).

        ``actor_args(key)`` gives each actor's constructor ``(args, kwargs)``; ``key`` is
        a number unique within the pool, so replacements get fresh seeds. ``on_timeout``
        is ``raise`` (kill the stuck actor and raise :class:`CallTimeoutError`) or
        ``retry`` (kill it and run the ticket elsewhere, up to ``max_attempts``).
        ``queue_depth`` is how many calls an actor holds at once: with 2 or more, the
        next calls wait in the actor's own queue (their arguments fetched meanwhile) and
        start the moment the running one returns, with no round trip through this
        process; every call held by an actor that dies is retried or lost with it.
        """
        if on_timeout not in ("raise", "retry"):
            raise ValueError(f"on_timeout must be 'raise' or 'retry', got {on_timeout!r}")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError(f"queue_depth must be an integer >= 1, got {queue_depth!r}")
        self.queue_depth = queue_depth
        self.role = role
        self._cls = actor_cls
        self._args = actor_args or (lambda key: ((), {}))
        self._placer = placer or default_placer
        self.call_timeout_s = call_timeout_s
        self.on_timeout = on_timeout
        self.max_attempts = max_attempts
        self.max_start_failures = max_start_failures
        self.start_timeout_s = start_timeout_s
        self._lock = threading.RLock()
        self._keys = itertools.count()
        self._tickets_ids = itertools.count()
        self._members: dict[int, _Member] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._queue: deque[int] = deque()
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

    def submit(self, method: str, *args: Any, retry: bool = True, **kwargs: Any) -> int:
        """Queue one call of ``method``; returns a ticket for :meth:`gather`.

        >>> t = pool.submit("square", 3); pool.gather([t], timeout_s=30)[t]
        9
        """
        with self._lock:
            self._check_open()
            tid = next(self._tickets_ids)
            self._tickets[tid] = _Ticket(tid, method, args, kwargs, retry)
            self._queue.append(tid)
            self._dispatch()  # start now on an idle actor: work must not wait for the next gather
            return tid

    def gather(self, tickets: Iterable[int], *, timeout_s: float, partial: bool = False, refs: bool = False) -> dict[int, Any]:
        """Wait for ``tickets``; returns {ticket: result}.

        With ``partial=False`` every ticket must finish by the deadline, else
        :class:`CallTimeoutError` names the unfinished calls. With ``partial=True`` the
        call returns at the deadline (or once nothing is left to wait for) with the
        tickets that finished; :meth:`lost` tells which were given up. Either way the
        tickets are done with afterwards: unfinished ones are dropped.

        With ``refs=True`` each result comes as ``(value, ObjectRef)``: the reference can
        go on to another actor's call without copying the result into the object store
        again. Hold ``value`` until that call is done: it pins the copy on the caller's
        node, which outlives the node of the actor that made the result.
        """
        tickets = list(tickets)
        try:
            out = self._gather(tickets, timeout_s, partial)
            if refs:
                with self._lock:
                    out = {t: (v, self._tickets[t].ref) for t, v in out.items()}
            return out
        except PoolError as exc:
            exc.role = self.role.name
            raise
        finally:
            self._forget(tickets)

    def _gather(self, tickets: list[int], timeout_s: float, partial: bool) -> dict[int, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = [t for t in tickets if not self._tickets[t].done and self._tickets[t].lost is None]
                errors = [self._tickets[t] for t in tickets if self._tickets[t].error is not None]
            if errors:
                with self._lock:
                    # Drop what has not started; let running calls finish so that every
                    # actor that hits the same bug is named in one grouped error.
                    for t in pending:
                        if t in self._queue:
                            self._queue.remove(t)
                            self._tickets[t].lost = "dropped after an error"
                    running = {t for m in self._members.values() for t in m.held()} & set(pending)
                if not running or time.monotonic() >= deadline:
                    grouped: dict[str, list[str]] = {}
                    for t in errors:
                        grouped.setdefault(t.error, []).append(t.actor or "?")
                    raise WorkError(errors[0].method, grouped)
                self._pump(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                if partial:
                    break
                raise CallTimeoutError(self._describe_pending(pending, timeout_s))
            self._pump(min(0.5, deadline - now))
        with self._lock:
            out = {t: self._tickets[t].result for t in tickets if self._tickets[t].done}
            lost = [t for t in tickets if self._tickets[t].lost is not None]
            if not partial and lost:
                reasons = {self._tickets[t].lost for t in lost}
                raise PoolError(f"{len(lost)} call(s) were lost with their actors: {'; '.join(sorted(reasons))}")
            self._lost_last = lost
            return out

    def poll(self, wait_s: float = 0.0) -> None:
        """Collect finished calls and start queued ones, waiting at most ``wait_s`` for a
        call to finish. A pool moves work only while one of its methods runs; a caller
        that keeps two pools busy at once (samplers feeding a trainer) polls the one it
        is not waiting on."""
        self._check_open()
        try:
            self._pump(max(0.0, wait_s))
        except PoolError as exc:
            exc.role = self.role.name
            raise

    def finished(self, ticket: int) -> bool:
        """Whether :meth:`gather` would return ``ticket`` at once (a result, an error, or given up)."""
        with self._lock:
            tk = self._tickets.get(ticket)
            return tk is None or tk.done or tk.error is not None or tk.lost is not None

    def cancel(self, tickets: Iterable[int]) -> None:
        """Give up tickets without waiting: queued ones never run, running results are dropped."""
        self._forget(tickets)

    def lost(self) -> list[int]:
        """Tickets of the last partial gather that were given up (their actor died, retry=False)."""
        return list(getattr(self, "_lost_last", []))

    def map(self, method: str, items: Iterable[Any], *, timeout_s: float) -> list[Any]:
        """Call ``method(item)`` for every item, spread over the actors; results in item order.

        >>> pool.map("square", [1, 2, 3], timeout_s=30)
        [1, 4, 9]
        """
        tickets = [self.submit(method, item) for item in items]
        done = self.gather(tickets, timeout_s=timeout_s)
        return [done[t] for t in tickets]

    def call_all(self, method: str, *args: Any, timeout_s: float, require_all: bool = False, **kwargs: Any) -> list[Any]:
        """Call ``method`` once on every live actor; results of the actors that answered.

        Actors still starting get the call too (after their start-up). ``require_all=True`` raises :class:`PoolError` if an actor died
        instead of answering (for calls that carry state, such as loading a checkpoint).

        >>> pool.call_all("set_weights", ray.put(w), timeout_s=30)
        """
        with self._lock:
            self._check_open()
            members = [m for m in self._members.values() if not m.retiring]
            refs = {}
            for m in members:
                ref = getattr(m.handle, method).remote(*args, **kwargs)
                refs[m.key] = ref
                if not m.ready:
                    m.ready_ref = ref  # the actor is ready once this (queued after start-up) is done
        results = {}
        deadline = time.monotonic() + timeout_s
        lost = []
        for key, ref in refs.items():
            try:
                results[key] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                m = self._members.get(key)
                err = CallTimeoutError(f"{method!r} on actor {m.name if m else key} of role {self.role.name!r} did not return within {timeout_s:.1f} s")
                err.role = self.role.name
                raise err from None
            except LOST as exc:
                lost.append(key)
                self._evict(key, f"died during {method!r}: {type(exc).__name__}")
            except RayTaskError as exc:
                m = self._members.get(key)
                err = WorkError(method, {_short(exc): [m.name if m else str(key)]})
                err.role = self.role.name
                raise err from None
        self._fill()
        if require_all and lost:
            err = PoolError(f"pool {self.role.name!r}: {len(lost)} actor(s) died during {method!r}; their replacements did not get it")
            err.role = self.role.name
            raise err
        return [results[k] for k in refs if k in results]

    def wait_for(self, n: int, timeout_s: float) -> None:
        """Block until at least ``n`` actors are ready (see :meth:`wait_ready`)."""
        self._wait(n, timeout_s)

    def resize(self, n: int) -> None:
        """Set the target size. Growth starts actors now; shrinking retires actors once
        their in-flight call has finished, so no work is lost."""
        with self._lock:
            self._check_open()
            self._check_size(n)
            self.target = n
            active = [m for m in self._members.values() if not m.retiring]
            extra = len(active) - n
            if extra > 0:
                # Retire idle actors first, then spot before on-demand, newest first.
                active.sort(key=lambda m: (m.ticket is not None, m.market != "spot", -m.key))
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

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``target`` actors are ready; raises naming the reason if not in time."""
        self._wait(None, timeout_s)

    def _wait(self, n: int | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                ready = sum(1 for m in self._members.values() if m.ready and not m.retiring)
            want = self.target if n is None else n
            if ready >= want:
                return
            if time.monotonic() >= deadline:
                err = CallTimeoutError(
                    f"pool {self.role.name!r}: {ready} of {want} actors ready after {timeout_s:.1f} s"
                    + (f"; placement: {self._placement_error}" if self._placement_error else "")
                    + (f"; last start error: {self._last_start_error}" if self._last_start_error else "")
                )
                err.role = self.role.name
                raise err
            self._pump(min(0.5, max(0.01, deadline - time.monotonic())))

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
        """Kill every actor; pending tickets are dropped."""
        with self._lock:
            self._closed = True
            for m in self._members.values():
                ray.kill(m.handle, no_restart=True)
            self._members.clear()
            self._queue.clear()

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.role.name!r} is shut down")

    def _check_size(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < self.role.lo or n > self.role.hi:
            raise ValueError(f"pool {self.role.name!r}: size must be an integer in {self.role.lo}..{self.role.hi}, got {n!r}")

    def _forget(self, tickets: Iterable[int]) -> None:
        with self._lock:
            for t in tickets:
                tk = self._tickets.pop(t, None)
                if tk is not None and not tk.done and tk.lost is None:
                    try:
                        self._queue.remove(t)
                    except ValueError:
                        pass

    def _describe_pending(self, pending: list[int], waited: float) -> str:
        lines = [f"pool {self.role.name!r}: {len(pending)} call(s) unfinished after {waited:.1f} s:"]
        running = {t: m for m in self._members.values() for t in m.held()}
        for t in pending[:10]:
            tk = self._tickets[t]
            m = running.get(t)
            where = f"running on actor {m.name} for {time.monotonic() - m.call_started:.1f} s" if m else "queued, no free actor"
            lines.append(f"  {tk.method!r} (ticket {t}): {where}")
        if self._placement_error:
            lines.append(f"  placement: {self._placement_error}")
        return "\n".join(lines)

    def _fill(self) -> None:
        """Start actors until the non-retiring count reaches the target."""
        with self._lock:
            if self._closed:
                return
            missing = self.target - sum(1 for m in self._members.values() if not m.retiring)
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
                m = _Member(key, handle, node_id, market, created=time.monotonic(), resources=_resources(opts))
                m.ready_ref = handle.__ray_ready__.remote()
                self._members[key] = m

    def _warn_placement(self, message: str | None) -> None:
        """Log a placement failure once while it stays the same (the pool retries every
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
            if m.retiring and m.ticket is None and not m.queued:
                ray.kill(m.handle, no_restart=True)
                del self._members[m.key]
                self._evictions.append(Eviction(time.time(), m.name, m.node_id, reason))

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
            except Exception:  # already gone
                pass
            for tid in reversed(m.held()):  # requeued in their original order
                tk = self._tickets.get(tid)
                if tk is not None and not tk.done:
                    if tk.retry and tk.attempts < self.max_attempts:
                        self._queue.appendleft(tk.id)
                    else:
                        tk.lost = f"{tk.method!r} on {m.name}: {reason}"

    def _dispatch(self) -> None:
        # Idle actors first, then (with queue_depth > 1) the least loaded busy ones.
        open_ = [m for m in self._members.values() if m.ready and not m.retiring and len(m.held()) < self.queue_depth]
        while open_ and self._queue:
            m = min(open_, key=lambda m: (len(m.held()), m.key))
            tid = self._queue.popleft()
            tk = self._tickets.get(tid)
            if tk is None or tk.done:
                continue
            tk.attempts += 1
            tk.actor = m.name
            ref = getattr(m.handle, tk.method).remote(*tk.args, **tk.kwargs)
            if m.ticket is None:
                m.ticket, m.ref, m.call_started = tid, ref, time.monotonic()
            else:
                m.queued.append((tid, ref))
            if len(m.held()) >= self.queue_depth:
                open_.remove(m)

    def _pump(self, wait_s: float) -> None:
        """One round: replace, dispatch, wait a little for anything to finish, handle it."""
        if self._start_failures >= self.max_start_failures:
            err = PoolError(
                f"pool {self.role.name!r}: {self._start_failures} actors failed in their constructor or start-up calls; "
                f"last error: {self._last_start_error}"
            )
            err.role = self.role.name
            raise err
        self._fill()
        with self._lock:
            self._retire_idle()
            self._dispatch()
            watch = {}
            for m in self._members.values():
                if not m.ready:
                    watch[m.ready_ref] = (m.key, "ready")
                elif m.ref is not None:
                    watch[m.ref] = (m.key, "call")
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

    def _handle(self, key: int, kind: str, ref: Any) -> None:
        try:
            value = ray.get(ref, timeout=self.call_timeout_s)
            failure = None
        except LOST as exc:
            failure = ("lost", exc)
        except RayTaskError as exc:
            failure = ("error", exc)
        except GetTimeoutError as exc:  # the ref was ready; only a lost object gets here
            failure = ("lost", exc)
        with self._lock:
            m = self._members.get(key)
            if m is None:
                return
            if kind == "ready":
                if ref != m.ready_ref:
                    return  # an older start-up reference; a call_all made while it started is the one to wait for
                if failure is None:
                    m.ready = True
                    self._start_failures = 0
                    return
                # Only the actor's own code failing counts towards max_start_failures (a
                # constructor that always raises must fail the pool, not loop); losing
                # a node while actors start is ordinary spot weather.
                exc = failure[1]
                if failure[0] == "error" or getattr(exc, "actor_init_failed", False):
                    self._start_failures += 1
                self._evict(key, f"failed while starting: {_short(exc)}")
                return
            if ref != m.ref:
                return  # a result for a ticket the actor is no longer running
            tk = self._tickets.get(m.ticket) if m.ticket is not None else None
            if failure is not None and failure[0] == "lost":
                self._evict(key, f"died during {tk.method if tk else 'a call'!r}: {type(failure[1]).__name__}")
                return
            m.busy_s += time.monotonic() - m.call_started
            m.ticket, m.ref = None, None
            if m.queued:  # the actor has started the next one already
                (m.ticket, m.ref), m.call_started = m.queued.pop(0), time.monotonic()
            if tk is None or tk.done:
                return  # forgotten ticket (its gather gave up)
            if failure is None:
                tk.done, tk.result, tk.ref = True, value, ref
            else:
                tk.error = _short(failure[1])
            if m.retiring:
                self._retire_idle()

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            for m in [m for m in self._members.values() if not m.ready and now - m.created > self.start_timeout_s]:
                self._placement_error = f"an actor on node {m.node_id[:8]} did not start within {self.start_timeout_s:g} s (its resources never freed up?)"
                self._evict(m.key, f"not started within start_timeout_s={self.start_timeout_s:g} s")
            stuck = [m for m in self._members.values() if m.ticket is not None and now - m.call_started > self.call_timeout_s]
            for m in stuck:
                tk = self._tickets.get(m.ticket)
                what = f"{tk.method!r}" if tk else "a call"
                msg = (
                    f"pool {self.role.name!r}: {what} on actor {m.name} (node {m.node_id[:8]}) did not return "
                    f"within call_timeout_s={self.call_timeout_s:g} s; the actor was killed and replaced"
                )
                if tk is not None and self.on_timeout == "raise":
                    tk.lost = msg
                    m.ticket = None
                    self._evict(m.key, "call timed out")
                    err = CallTimeoutError(msg)
                    err.role = self.role.name
                    raise err
                self._evict(m.key, "call timed out")


def _resources(opts: dict) -> dict[str, float]:
    res = {"CPU": float(opts.get("num_cpus", 0.0)), "GPU": float(opts.get("num_gpus", 0.0))}
    res.update(opts.get("resources", {}))
    return {k: v for k, v in res.items() if v}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(exc: BaseException) -> str:
    """The error without Ray's per-process header, so equal errors compare equal."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = _ANSI.sub("", str(exc)).strip()
    return text if len(text) < 2000 else text[:2000] + " ..."
