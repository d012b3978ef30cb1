"""The trainers' calls, gathered with a deadline: every shard's answer, or one error that
says which trainers were lost, which broke the collective, and which were killed for
staying inside it after a peer failed (they may be blocked on a peer that is gone).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray import ObjectRefGenerator
from ray.exceptions import RayTaskError

from raylane.jobs.xgboost_collective import first_line, is_collective_error
from raylane.errors import LOST, CallTimeoutError, PoolError, WorkError

ROLE = "xgboost_trainer"


class GroupLost(PoolError):
    """A trainer died mid-call or the collective broke. Recoverable: the driver regroups."""

    def __init__(self, message: str, actor: str = "?"):
        super().__init__(message)
        self.actor = actor


def collect(calls: dict[int, Any], handles: dict[int, Any], *, what: str, timeout_s: float, grace_s: float) -> dict[int, Any]:
    """One result per shard, never waiting past ``timeout_s``.

    ``calls`` maps a shard to an ObjectRef, or to a streaming generator whose next item is
    wanted. Once any call has failed, the others get ``grace_s`` to finish (survivors of a
    broken collective leave it with an error); those still running are killed, since they
    may be blocked on a peer that is gone. A lost trainer, or collective errors only, raise
    :class:`GroupLost` (recoverable); any other error raises :class:`WorkError`.
    """
    pending = {ref: i for i, ref in calls.items()}
    results: dict[int, Any] = {}
    lost: dict[int, str] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + grace_s)
        left = limit - time.monotonic()
        if left <= 0:
            break
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
        for ready in done:
            i = pending.pop(ready)
            try:
                ref = next(ready) if isinstance(ready, ObjectRefGenerator) else ready
                results[i] = ray.get(ref, timeout=max(1.0, left))
            except StopIteration:
                errors[i] = f"{what!r} ended before its last chunk"
            except LOST as exc:
                lost[i] = type(exc).__name__
            except RayTaskError as exc:
                errors[i] = str(getattr(exc, "cause", None) or exc)
            if i not in results and failed_at is None:
                failed_at = time.monotonic()
    stuck = sorted(pending.values())
    for i in stuck:
        ray.kill(handles[i], no_restart=True)
    if not (lost or errors or stuck):
        return results
    if errors and not lost and not all(is_collective_error(e) for e in errors.values()):
        grouped: dict[str, list[str]] = {}
        for i, e in errors.items():
            grouped.setdefault(first_line(e), []).append(f"shard {i}")
        err: PoolError = WorkError(what, grouped)  # a bug or bad data: not worth retrying
    elif failed_at is None:
        err = CallTimeoutError(f"{what!r} on shard(s) {stuck} did not return within {timeout_s:g} s; those trainers were killed")
    else:
        parts = [f"shard {i}: trainer lost ({why})" for i, why in sorted(lost.items())]
        parts += [f"shard {i}: {first_line(e)}" for i, e in sorted(errors.items())]
        parts += [f"shard {i}: still in the collective {grace_s:g} s after the first failure, killed" for i in stuck]
        err = GroupLost(f"{what!r} failed: " + "; ".join(parts), actor=", ".join(f"shard {i}" for i in sorted(lost) or stuck or sorted(errors)))
    err.role = ROLE  # the failure policy counts failures per role
    raise err


def drain(chunks: dict[int, ObjectRefGenerator], handles: dict[int, Any], *, grace_s: float) -> None:
    """Wait until every stream has ended (a broken collective ends them with an error);
    kill the trainers whose stream is still running after ``grace_s``."""
    pending = {gen: i for i, gen in chunks.items()}
    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
        for gen in done:
            try:
                ray.get(next(gen), timeout=max(1.0, left))
            except StopIteration:
                pending.pop(gen)
            except Exception:  # noqa: BLE001 - a stream that raised (its trainer died or its collective broke) has ended
                pending.pop(gen)
    for i in pending.values():
        ray.kill(handles[i], no_restart=True)
