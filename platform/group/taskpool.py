"""The task pool: stateless roles on top of membership.

Work is submitted as tickets; each ticket runs on one actor at a time and its result is
recorded exactly once. When an actor dies, its membership evicts it and starts a
replacement; the dead actor's tickets go back in the queue (or are reported lost, for
tickets submitted with ``retry=False``). The other actors keep working throughout. An
actor holds one call at a time, or up to ``queue_depth`` (the next ones waiting in its
own queue, so it never idles for a round trip through the pool's process).

No wait is unbounded: each call has ``call_timeout_s`` and each gather a deadline, and
both raise errors that name the actor, its node and the method.

Example::

    pool = TaskPool(RoleSpec("worker", count=2), Worker, actor_args=lambda k: ((k,), {}))
    squares = pool.map("square", [1, 2, 3, 4], timeout_s=60)
    pool.call_all("set_weights", weights_ref, timeout_s=30)
    pool.resize(4)
    pool.shutdown()
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from raylane.errors import LOST, CallTimeoutError, PoolError, WorkError, short_error
from raylane.group.membership import Member, Membership, Placer
from raylane.placement import RoleSpec


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


class TaskPool(Membership):
    """Interchangeable actors of one role working through tickets; see the module docstring."""

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
        """Start ``size`` actors (default: the role's ``hi``); see :class:`Membership`.

        ``on_timeout`` is ``raise`` (kill the stuck actor and raise
        :class:`CallTimeoutError`) or ``retry`` (kill it and run the ticket elsewhere, up
        to ``max_attempts``). ``queue_depth`` is how many calls an actor holds at once:
        with 2 or more, the next calls wait in the actor's own queue (their arguments
        fetched meanwhile) and start the moment the running one returns, with no round
        trip through this process; every call held by an actor that dies is retried or
        lost with it.
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
        self.call_timeout_s = call_timeout_s
        self.on_timeout = on_timeout
        self.max_attempts = max_attempts
        self._tickets_ids = itertools.count()
        self._tickets: dict[int, _Ticket] = {}
        self._queue: deque[int] = deque()
        self._lost_last: list[int] = []
        # Set when an actor of a stateful role is lost: its replacement holds no state until
        # the run restores it (restored()), so no ticket may reach it before then.
        self._stale: str | None = None
        super().__init__(role, actor_cls, actor_args=actor_args, size=size, placer=placer,
                         max_start_failures=max_start_failures, start_timeout_s=start_timeout_s)

    # ---------------------------------------------------------------- tickets

    def submit(self, method: str, *args: Any, retry: bool = True, **kwargs: Any) -> int:
        """Queue one call of ``method``; returns a ticket for :meth:`gather`.

        >>> t = pool.submit("square", 3); pool.gather([t], timeout_s=30)[t]
        9
        """
        with self._lock:
            self._check_open()
            if self._stale is not None:
                raise self._named(PoolError(f"{self._stale}; no call goes to its replacement before the run restores its state"))
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
            raise self._named(exc)
        finally:
            self._forget(tickets)

    def _gather(self, tickets: list[int], timeout_s: float, partial: bool) -> dict[int, Any]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            abandoned = [t for t in tickets if t not in self._tickets]
            tickets = [t for t in tickets if t in self._tickets]
        if abandoned and not partial:
            raise PoolError(f"{len(abandoned)} call(s) were abandoned (their step failed, or they were cancelled): gather new ones")
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
            self._lost_last = lost + abandoned
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
            raise self._named(exc)

    def finished(self, ticket: int) -> bool:
        """Whether :meth:`gather` would return ``ticket`` at once (a result, an error, or given up)."""
        with self._lock:
            tk = self._tickets.get(ticket)
            return tk is None or tk.done or tk.error is not None or tk.lost is not None

    def cancel(self, tickets: Iterable[int]) -> None:
        """Give up tickets without waiting: queued ones never run, running results are dropped."""
        self._forget(tickets)

    def abandon(self) -> None:
        """Give up every ticket not yet done: queued ones never run, results of running ones
        are dropped. The driver calls it when a step fails, so that no call of that step
        reaches an actor (a replacement above all) after the run has been rolled back."""
        with self._lock:
            self._forget(list(self._tickets))

    def restored(self) -> None:
        """The run has restored this pool's state (a stateful role's replacement loaded the
        checkpoint): tickets may be submitted again."""
        with self._lock:
            self._stale = None

    def lost(self) -> list[int]:
        """Tickets of the last partial gather that were given up (their actor died, retry=False)."""
        return list(self._lost_last)

    def map(self, method: str, items: Iterable[Any], *, timeout_s: float) -> list[Any]:
        """Call ``method(item)`` for every item, spread over the actors; results in item order.

        >>> pool.map("square", [1, 2, 3], timeout_s=30)
        [1, 4, 9]
        """
        tickets = [self.submit(method, item) for item in items]
        done = self.gather(tickets, timeout_s=timeout_s)
        return [done[t] for t in tickets]

    def call_one(self, method: str, *args: Any, timeout_s: float, start_timeout_s: float = 180.0) -> Any:
        """The answer of a one-actor pool's actor (a trainer fed through the pool's queue,
        whose state is the job's state): waits up to ``start_timeout_s`` for it to be
        ready; raises :class:`PoolError` if it died instead of answering."""
        if self.target != 1:
            raise ValueError(f"call_one is for a pool of one actor; role {self.role.name!r} has {self.target}")
        self.wait_for(1, timeout_s=start_timeout_s)
        results = self.call_all(method, *args, timeout_s=timeout_s, require_all=True)
        if len(results) != 1:
            raise self._named(PoolError(f"expected the one actor of role {self.role.name!r} to answer {method!r}, got {len(results)} answers"))
        return results[0]

    def call_all(self, method: str, *args: Any, timeout_s: float, require_all: bool = False, **kwargs: Any) -> list[Any]:
        """Call ``method`` once on every live actor; results of the actors that answered.

        Actors still starting get the call too (after their start-up). ``require_all=True``
        raises :class:`PoolError` if an actor died instead of answering (for calls that
        carry state, such as loading a checkpoint).

        >>> pool.call_all("set_weights", ray.put(w), timeout_s=30)
        """
        with self._lock:
            self._check_open()
            refs = {}
            for m in [m for m in self._members.values() if not m.retiring]:
                refs[m.key] = ref = getattr(m.handle, method).remote(*args, **kwargs)
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
                raise self._named(CallTimeoutError(f"{method!r} on actor {m.name if m else key} of role {self.role.name!r} did not return within {timeout_s:.1f} s")) from None
            except LOST as exc:
                lost.append(key)
                self._evict(key, f"died during {method!r}: {type(exc).__name__}")
            except RayTaskError as exc:
                m = self._members.get(key)
                raise self._named(WorkError(method, {short_error(exc): [m.name if m else str(key)]})) from None
        self._fill()
        if require_all and lost:
            raise self._named(PoolError(f"pool {self.role.name!r}: {len(lost)} actor(s) died during {method!r}; their replacements did not get it"))
        return [results[k] for k in refs if k in results]

    def shutdown(self) -> None:
        """Kill every actor; pending tickets are dropped."""
        super().shutdown()
        with self._lock:
            self._queue.clear()

    # ---------------------------------------------------------------- membership hooks

    def _left(self, m: Member, reason: str) -> None:
        if self.role.stateful:
            # The actor's state went with it and its replacement starts empty: retrying a
            # call there (or running the next queued one) would train a fresh model as if
            # nothing happened. Every unfinished call is lost, and the pool takes no new
            # ones until the run has restored the state (restored()).
            self._stale = f"actor {m.name} of stateful role {self.role.name!r} was lost ({reason})"
            for tk in self._tickets.values():
                if not tk.done and tk.lost is None and tk.error is None:
                    tk.lost = f"{tk.method!r}: {self._stale}"
            self._queue.clear()
            return
        for tid in reversed(m.held()):  # requeued in their original order
            tk = self._tickets.get(tid)
            if tk is not None and not tk.done:
                if tk.retry and tk.attempts < self.max_attempts:
                    self._queue.appendleft(tk.id)
                else:
                    tk.lost = f"{tk.method!r} on {m.name}: {reason}"

    def _before_wait(self) -> None:
        self._dispatch()

    def _watch(self) -> dict[Any, tuple[int, str]]:
        watch = super()._watch()
        watch.update({m.ref: (m.key, "call") for m in self._members.values() if m.ready and m.ref is not None})
        return watch

    def _handle(self, key: int, kind: str, ref: Any) -> None:
        if kind != "call":
            return super()._handle(key, kind, ref)
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
            if m is None or ref != m.ref:
                return  # gone, or a result for a ticket the actor is no longer running
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
                tk.error = short_error(failure[1])
            if m.retiring:
                self._retire_idle()

    def _check_timeouts(self) -> None:
        super()._check_timeouts()
        now = time.monotonic()
        with self._lock:
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
                    raise self._named(CallTimeoutError(msg))
                self._evict(m.key, "call timed out")

    # ---------------------------------------------------------------- internals

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
