"""The gang: stateful, ranked roles on top of membership.

Each rank 0..n-1 is held by one live actor and keeps that actor for as long as it lives:
a rank is the actor's identity (its data shard, its slice of the parameters, its layers).
When the actor holding a rank is lost, the membership replaces it and the next
:meth:`Gang.form` hands the free replacement the lost rank and calls ``on_join(rank,
handle)``, where the workload gives the actor its identity (no actor needs a two-phase
start). A single learner or trainer is a gang of one.

:meth:`Gang.gather` is the one "wait for every rank, with a deadline and a grace period,
then kill who is left" loop. The ranks of a gang usually wait on each other (a
collective, a pipeline, a parameter exchange), so once one rank has failed the others
get ``grace_s`` to leave with their own error; a rank still inside its call after that
may be blocked on a peer that is gone, and is killed. The outcome is one error: a
:class:`GroupLost` naming the ranks (recoverable: regroup and resume from the last
checkpoint) when ranks were lost, timed out, or raised what the workload's ``broken``
predicate calls a broken collective; otherwise a grouped :class:`WorkError` (a bug or bad
data: not retried).

Example::

    gang = Gang(RoleSpec("trainer", count=4, stateful=True), Trainer,
                on_join=lambda rank, h: h.load.remote(shards[rank]))
    gang.form(timeout_s=120)
    out = gang.call("train", timeout_s=600, grace_s=30)   # {rank: result}
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import ObjectRefGenerator
from ray.exceptions import RayTaskError

from raylane.errors import LOST, CallTimeoutError, GroupLost, PoolError, WorkError
from raylane.group.membership import Member, Membership, Placer
from raylane.placement import RoleSpec


def _gist(exc: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]


@dataclass
class Outcome:
    """What :func:`wait_ranks` saw: results, lost ranks (why), ranks whose call raised,
    and ranks still inside their call when the wait ended."""

    results: dict[int, Any]
    lost: dict[int, str]
    errors: dict[int, BaseException]
    stuck: list[int]
    first_failure: float | None


def wait_ranks(calls: dict[int, Any], *, what: str, timeout_s: float, grace_s: float,
               on_failure: Callable[[], None] | None = None, ids: dict[int, str] | None = None) -> Outcome:
    """The one wait of the group package for ranked calls: every rank's answer until
    ``timeout_s``, or until ``grace_s`` after the first failure. A rank's call may be a
    list of references (its answer is then the list of their values). A lost-actor error
    about another actor than the rank's own (``ids``: {rank: actor id}; a result passed
    from a peer that died) counts as that rank's error, not as the rank being lost."""
    pending: dict[Any, tuple[int, int]] = {}
    shape: dict[int, int] = {}
    for r, call in calls.items():
        refs = call if isinstance(call, list) else [call]
        shape[r] = len(refs) if isinstance(call, list) else -1
        pending.update({ref: (r, i) for i, ref in enumerate(refs)})
    parts: dict[int, dict[int, Any]] = {r: {} for r in calls}
    lost: dict[int, str] = {}
    errors: dict[int, BaseException] = {}
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + grace_s)
        left = limit - time.monotonic()
        if left <= 0:
            break
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
        for ready in done:
            r, i = pending.pop(ready)
            try:
                ref = next(ready) if isinstance(ready, ObjectRefGenerator) else ready
                parts[r][i] = ray.get(ref, timeout=max(1.0, left))
                continue
            except StopIteration:
                err: BaseException = RuntimeError(f"{what!r} ended before its last item")
            except LOST as exc:
                theirs = getattr(exc, "actor_id", None)
                if ids is None or theirs is None or theirs == ids.get(r):
                    lost.setdefault(r, type(exc).__name__)
                    err = exc
                else:
                    err = PeerLost(f"a result {what!r} needed came from an actor that is gone ({type(exc).__name__})")
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                err = cause if isinstance(cause, BaseException) else exc
            if r not in lost:
                errors.setdefault(r, err)
            if failed_at is None:
                failed_at = time.monotonic()
                if on_failure is not None:
                    on_failure()
    for r in lost:
        errors.pop(r, None)
    stuck = sorted({r for r, _ in pending.values()} - set(lost) - set(errors))
    results = {r: ([got[i] for i in range(shape[r])] if shape[r] >= 0 else got[0]) for r, got in parts.items()
               if r not in lost and r not in errors and r not in stuck}
    return Outcome(results, lost, errors, stuck, failed_at)


def judge(out: Outcome, *, what: str, timeout_s: float, grace_s: float, broken: Callable[[BaseException], bool] = lambda e: False,
          brief: Callable[[BaseException], str] = _gist, rank_name: str = "rank", actor_word: str = "actor", killed: bool = True) -> PoolError | None:
    """The one error an :class:`Outcome` comes to (None when every rank answered): a
    grouped :class:`WorkError` when ranks raised and none was lost and not every error is
    ``broken`` (a bug or bad data: not worth retrying), :class:`CallTimeoutError` when
    ranks merely ran out of time, otherwise :class:`GroupLost` naming the ranks."""
    lost, errors, stuck = out.lost, out.errors, out.stuck
    if not (lost or errors or stuck):
        return None
    n = rank_name
    if errors and not lost and not all(isinstance(e, PeerLost) or broken(e) for e in errors.values()):
        grouped: dict[str, list[str]] = {}
        for r, e in sorted(errors.items()):
            if not isinstance(e, PeerLost):
                grouped.setdefault(brief(e), []).append(f"{n} {r}")
        return WorkError(what, grouped)
    if out.first_failure is None:
        return CallTimeoutError(f"{what!r} on {n}(s) {stuck} did not return within {timeout_s:g} s" + ("; those actors were killed" if killed else ""))
    parts = [f"{n} {r}: {actor_word} lost ({why})" for r, why in sorted(lost.items())]
    parts += [f"{n} {r}: {brief(e)}" for r, e in sorted(errors.items())]
    parts += [f"{n} {r}: still in the collective {grace_s:g} s after the first failure" + (", killed" if killed else "") for r in stuck]
    ranks = sorted(lost) or stuck or sorted(errors)
    return GroupLost(f"{what!r} failed: " + "; ".join(parts), ranks=ranks, actor=", ".join(f"{n} {r}" for r in ranks))


def gather_ranks(calls: dict[int, Any], *, what: str, timeout_s: float, grace_s: float, on_failure: Callable[[], None] | None = None,
                 broken: Callable[[BaseException], bool] = lambda e: False, rank_name: str = "rank") -> dict[int, Any]:
    """:meth:`Gang.gather` for ranked actors that no gang owns (a test's or a benchmark's
    own actors): the same wait and the same one error, but nobody is killed or replaced."""
    out = wait_ranks(calls, what=what, timeout_s=timeout_s, grace_s=grace_s, on_failure=on_failure)
    err = judge(out, what=what, timeout_s=timeout_s, grace_s=grace_s, broken=broken, rank_name=rank_name, killed=False)
    if err is not None:
        raise err
    return out.results


class PeerLost(RuntimeError):
    """A rank's call failed because a result it was handed came from an actor that died."""


class Gang(Membership):
    """Ranked actors of one stateful role; see the module docstring for the contract."""

    def __init__(
        self,
        role: RoleSpec,
        actor_cls: Any,
        *,
        size: int | None = None,
        actor_args: Callable[[int], tuple[tuple, dict]] | None = None,
        on_join: Callable[[int, Any], Any] | None = None,
        broken: Callable[[BaseException], bool] | None = None,
        brief: Callable[[BaseException], str] | None = None,
        rank_order: Callable[[str], Any] | None = None,
        rank_name: str = "rank",
        actor_word: str = "actor",
        elastic: bool = False,
        placer: Placer | None = None,
        max_start_failures: int = 3,
        start_timeout_s: float = 180.0,
        spares: int = 0,
    ):
        """``on_join(rank, handle)`` returns an ObjectRef (or None) for the call that gives a
        newly ranked actor its identity; :meth:`form` gathers them. ``broken(error)`` says
        an error a method raised means the gang's collective broke (recoverable: a peer is
        gone or timed out), not a bug.
        ``brief(error)`` shortens an error for messages. ``rank_order(node_id)`` sorts
        the actors of the first formation (rank 0 first: e.g. the fastest node).
        ``rank_name`` and ``actor_word`` are what a rank and its actor are called in
        messages (``shard``/``trainer``, ``stage``). An ``elastic`` gang's workload cuts
        its work over whoever is live: it may be resized within the role's bounds, and
        :meth:`deal` gives out the ranks (see there).

        ``spares``: started actors kept beside the ranks, holding none. A lost rank is then
        taken over at the next :meth:`form` (an elastic gang: its workload's next deal over
        at most ``target`` actors) by a spare that is already running, and a new spare
        starts in the background, so a recovery does not wait for an actor to start
        (seconds: a process, its imports, a GPU context). Spares start after the ranks and
        only where the cluster has room; one that cannot be placed is a placement warning,
        not an error."""
        if not isinstance(spares, int) or spares < 0:
            raise ValueError(f"role {role.name!r}: spares={spares!r}: use a whole number, 0 or more")
        self.spares = 0  # until the ranks have started (the membership sizes itself without them)
        self._ranks: dict[int, int] = {}  # rank -> member key
        self.elastic = elastic
        self._width: int | None = None  # an elastic gang's number of ranks, once dealt
        self._on_join = on_join
        self._broken = broken or (lambda exc: False)
        self._brief = brief or _gist
        self._rank_order = rank_order
        self.rank_name = rank_name
        self.actor_word = actor_word
        super().__init__(role, actor_cls, actor_args=actor_args, size=size, placer=placer,
                         max_start_failures=max_start_failures, start_timeout_s=start_timeout_s)
        if spares:  # after the ranks, so they are placed beside them (counted), not on their planned room
            self.spares = spares
            self._fill()

    # ---------------------------------------------------------------- ranks

    def handles(self) -> dict[int, Any]:
        """{rank: actor handle} of the ranks held by a live actor."""
        with self._lock:
            return {r: self._members[k].handle for r, k in sorted(self._ranks.items()) if k in self._members}

    def nodes(self) -> dict[int, str]:
        """{rank: node id} of the ranks held by a live actor."""
        with self._lock:
            return {r: self._members[k].node_id for r, k in sorted(self._ranks.items()) if k in self._members}

    def spare_markets(self) -> list[str]:
        """The market of each started actor that holds no rank (the hot spares)."""
        with self._lock:
            held = set(self._ranks.values())
            return sorted(m.market for m in self._members.values() if not m.retiring and m.key not in held)

    def missing(self) -> list[int]:
        """Ranks no live actor holds (until the next :meth:`form` or :meth:`deal`)."""
        with self._lock:
            return [r for r in range(self.width) if r not in self._ranks]

    @property
    def width(self) -> int:
        """The number of ranks: the size (``target``; spares not counted), or what an elastic gang was last dealt."""
        return self.target if self._width is None else self._width

    def deal(self, order: list[Any]) -> None:
        """Elastic gangs only: ranks 0..k-1 go to these live actors (handles, in rank
        order), whatever they held before; the gang now has k ranks. The workload has
        re-cut its work over them (e.g. layers over the stages that are live)."""
        if not self.elastic:
            raise ValueError(f"role {self.role.name!r}: deal() is for an elastic gang; a fixed gang's ranks are given by form()")
        with self._lock:
            keys = {id(m.handle): m.key for m in self._members.values() if m.ready and not m.retiring}
            absent = [i for i, h in enumerate(order) if id(h) not in keys]
            if absent:
                raise self._lost_ranks(absent, "deal() was given actors that are not live members")
            self._ranks = {r: keys[id(h)] for r, h in enumerate(order)}
            self._width = len(order)

    def form(self, timeout_s: float, grace_s: float | None = None) -> dict[int, Any]:
        """Every rank on a live actor. Lost actors are evicted (their replacements start
        at once), the gang waits until all are ready, free actors take the missing ranks
        (lowest rank first; an actor on a node where another just died last), and
        ``on_join`` runs for each of them. Returns {rank:
        on_join's result} for the ranks that joined now (empty when none was missing)."""
        self.probe(timeout_s)
        self.wait_ready(timeout_s)  # the ranks' actors, not the spares: they are for the next loss
        with self._lock:
            held = set(self._ranks.values())
            free = [m for m in self._members.values() if m.ready and not m.retiring and m.key not in held]
            order = self._rank_order if (self._rank_order is not None and not self._ranks) else None
            free.sort(key=(lambda m: (order(m.node_id), m.node_id, m.key)) if order else (lambda m: (self._suspect(m), m.key)))
            joined = dict(zip(self.missing(), free))
            for r, m in joined.items():
                self._ranks[r] = m.key
        if not joined:
            return {}
        if self._on_join is None:
            return {r: None for r in joined}
        calls = {r: self._on_join(r, m.handle) for r, m in joined.items()}
        waiting = {r: ref for r, ref in calls.items() if ref is not None}
        out = self.gather(waiting, what="on_join", timeout_s=timeout_s, grace_s=timeout_s if grace_s is None else grace_s) if waiting else {}
        return {r: out.get(r) for r in calls}

    def call(self, method: str, *args: Any, timeout_s: float, grace_s: float, per_rank: Callable[[int], tuple[tuple, dict]] | None = None, **kwargs: Any) -> dict[int, Any]:
        """Call ``method`` on every rank and :meth:`gather` the answers. ``per_rank(rank)``
        gives a rank its own ``(args, kwargs)``; otherwise every rank gets ``args``/``kwargs``."""
        handles = self.handles()
        if len(handles) < self.width:
            raise self._lost_ranks(self.missing(), f"{method!r} needs every rank")
        calls = {}
        for r, h in handles.items():
            a, kw = per_rank(r) if per_rank is not None else (args, kwargs)
            calls[r] = getattr(h, method).remote(*a, **kw)
        return self.gather(calls, what=method, timeout_s=timeout_s, grace_s=grace_s)

    def gather(self, calls: dict[int, Any], *, what: str, timeout_s: float, grace_s: float,
               on_failure: Callable[[], None] | None = None) -> dict[int, Any]:
        """{rank: result} of ``calls`` ({rank: an ObjectRef, a list of them, or a streaming
        generator whose next item is wanted}), never waiting past ``timeout_s``; see the
        module docstring for the grace period and the one error raised. ``on_failure()``
        runs once, at the first failure (e.g. tell the other ranks to give up their
        collective now rather than at their own timeout). Lost and stuck ranks are evicted;
        the membership starts their replacements."""
        out = wait_ranks(calls, what=what, timeout_s=timeout_s, grace_s=grace_s, on_failure=on_failure, ids=self._actor_ids())
        self._evict_ranks({**{r: f"lost during {what!r}: {why}" for r, why in out.lost.items()},
                           **{r: f"still in {what!r} after the deadline, killed" for r in out.stuck}})
        err = judge(out, what=what, timeout_s=timeout_s, grace_s=grace_s, broken=self._broken, brief=self._brief,
                    rank_name=self.rank_name, actor_word=self.actor_word)
        if err is not None:
            raise self._named(err)
        return out.results

    def drain(self, streams: dict[int, ObjectRefGenerator], *, grace_s: float) -> None:
        """Wait until every stream has ended (a broken collective ends them with an error);
        kill the ranks whose stream is still running after ``grace_s``."""
        pending = {gen: r for r, gen in streams.items()}
        deadline = time.monotonic() + grace_s
        while pending and (left := deadline - time.monotonic()) > 0:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
            for gen in done:
                try:
                    ray.get(next(gen), timeout=max(1.0, left))
                except StopIteration:
                    pending.pop(gen)
                except Exception:  # noqa: BLE001 - a stream that raised (its actor died or its collective broke) has ended
                    pending.pop(gen)
        self._evict_ranks({r: f"still streaming {grace_s:g} s after the stream was closed, killed" for r in pending.values()})

    def resize(self, n: int) -> None:
        """A gang's size is its number of ranks, fixed for the run (an elastic gang's
        within the role's bounds: the workload deals the ranks again)."""
        if self.elastic:
            super().resize(n)
        elif n != self.target:
            raise ValueError(f"role {self.role.name!r} is a gang of {self.target} ranks; its size cannot change while it runs (got {n!r})")

    # ---------------------------------------------------------------- membership hooks

    def _keep(self) -> int:
        return self.target + self.spares

    def _left(self, m: Member, reason: str) -> None:
        for r, k in list(self._ranks.items()):
            if k == m.key:
                del self._ranks[r]

    # ---------------------------------------------------------------- internals

    def _suspect(self, m: Member, window_s: float = 30.0) -> bool:
        """Whether ``m`` was started before an actor on its node died (within ``window_s``):
        the node may be going before Ray says so, so a free actor elsewhere takes a rank first."""
        died = self._recent_dead_nodes.get(m.node_id)
        return died is not None and m.created < died and time.monotonic() - died < window_s

    def _actor_ids(self) -> dict[int, str]:
        with self._lock:
            return {r: self._members[k].handle._actor_id.hex() for r, k in self._ranks.items() if k in self._members}

    def _evict_ranks(self, reasons: dict[int, str]) -> None:
        with self._lock:
            for r, reason in reasons.items():
                key = self._ranks.get(r)
                if key is not None:
                    self._evict(key, reason)
        if reasons:
            self._fill()

    def _lost_ranks(self, ranks: list[int], why: str) -> PoolError:
        n = self.rank_name
        return self._named(GroupLost(f"{why}; no live actor holds {n}(s) {ranks}", ranks=ranks, actor=", ".join(f"{n} {r}" for r in ranks)))
