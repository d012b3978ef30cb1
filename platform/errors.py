"""One taxonomy of what can go wrong with an actor call, and which of it a run survives:
the actor (or its node) is gone (:data:`LOST`), a call ran past its deadline
(:class:`CallTimeoutError`), or the method itself raised (:class:`WorkError`, a bug or bad
data, never retried). :func:`is_recoverable` is the driver's reading of it.
"""

from __future__ import annotations

import re

from ray.exceptions import (
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
    WorkerCrashedError,
)

# Errors that mean "the actor (or its node) is gone", as opposed to a bug in the method.
LOST = (RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError, OutOfMemoryError, TaskCancelledError)


class PoolError(RuntimeError):
    """The pool cannot finish the work asked of it; the message says why and what to change.
    ``role`` names the pool's role, so the driver's failure policy can count per role."""

    role: str | None = None


class CallTimeoutError(PoolError, TimeoutError):
    """An actor call ran past its timeout. Names the actor, its node, the method and the wait."""


class WorkError(PoolError):
    """An actor method raised. Identical errors are grouped with the actors that raised them."""

    def __init__(self, method: str, errors: dict[str, list[str]]):
        self.errors = errors
        self.method = method
        parts = [f"{len(actors)} call(s) of {method!r} on {', '.join(actors)} raised:\n{msg}" for msg, actors in errors.items()]
        super().__init__("\n".join(parts))


class GroupLost(PoolError):
    """Ranks of a gang were lost, or their collective broke. Recoverable: the workload
    regroups (the gang replaces the lost ranks) and resumes from its checkpoint."""

    def __init__(self, message: str, ranks: list[int] | tuple[int, ...] = (), actor: str = "?"):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.actor = actor


def is_recoverable(exc: BaseException) -> bool:
    """Lost actors, lost nodes and timeouts are recoverable; a method that raised is a bug."""
    if isinstance(exc, WorkError):
        return False
    return isinstance(exc, LOST + (PoolError, TimeoutError))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def short_error(exc: BaseException) -> str:
    """The error without Ray's per-process header, so equal errors compare equal."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = _ANSI.sub("", str(exc)).strip()
    return text if len(text) < 2000 else text[:2000] + " ..."
