"""Budgets before work: a job's sizes checked against memory before anything big is made.

A config value with one zero too many (``graph.nodes=1000000000``, ``rows=10000000000``)
would otherwise fill the driver's memory, or an actor's, long before anything says no;
on a shared head node that takes everyone down. So each job adds up what its sizes will
cost, from formulas stated beside its call, and :func:`check` refuses a total above the
limit, naming every figure, the limit and the keys to lower. Estimates are honest to
within a factor of about two: a budget catches a size off by orders of magnitude, it does
not forecast a run's peak.

The limit is 80% (:data:`SAFETY`) of the memory available on this machine when the job is
built, for the driver and, per actor, for each actor: before Ray starts the driver cannot
know the nodes its actors will get, and an actor that needs more than this machine has is
almost always a typo. Inside a running Ray (a Tune trial) the per-actor limit is 80% of
the largest node's memory instead. ``RAYLANE_MEMORY_BUDGET_BYTES`` (a whole number of
bytes) replaces both limits: to admit a job sized for bigger nodes than the one it starts
on, or to test the refusal.

No Ray here (a look at one that already runs excepted): pure arithmetic, testable alone.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, NamedTuple, Sequence

from raylane.config import ConfigError

ENV_VAR = "RAYLANE_MEMORY_BUDGET_BYTES"
SAFETY = 0.8
"""Share of the available memory a job may plan to use: the rest is for Python, torch,
Ray's own processes and whatever else shares the machine."""

GiB = 2**30
MiB = 2**20
KiB = 2**10


class BudgetError(ConfigError):
    """A job's sizes would need more memory (or more work per step) than the limit. A
    :class:`~raylane.config.ConfigError`, so ``raylane run`` prints it and exits 2 before
    Ray starts."""


class Estimate(NamedTuple):
    """One figure of a job's memory: what it is (with its formula), its bytes, and the
    config key or keys that scale it."""

    what: str
    """E.g. ``"node features: graph.nodes (5000) x graph.feature_dim (32) x 12 bytes"``."""
    nbytes: float
    keys: str | tuple[str, ...]
    """Keys that shrink it when lowered."""
    more: tuple[str, ...] = ()
    """Keys that shrink it when raised (a divisor: shards, stages, trainers)."""


class Limit(NamedTuple):
    """A memory limit and where it comes from (said in the error)."""

    nbytes: int
    source: str


def size(n: float) -> str:
    """Bytes in the unit a reader takes in at once.

    >>> size(3 * GiB), size(1.5 * MiB), size(123)
    ('3.0 GiB', '1.5 MiB', '123 bytes')
    """
    if n >= GiB / 10:
        return f"{n / GiB:,.1f} GiB"
    if n >= MiB / 10:
        return f"{n / MiB:,.1f} MiB"
    return f"{n:,.0f} bytes"


def _override() -> Limit | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    try:
        n = int(float(raw.replace("_", "")))
    except ValueError:
        raise BudgetError(f"{ENV_VAR}={raw!r} is not a number of bytes (e.g. 8000000000 for 8 GB); fix or unset it") from None
    if n <= 0:
        raise BudgetError(f"{ENV_VAR}={raw!r} must be a positive number of bytes; fix or unset it")
    return Limit(n, f"{ENV_VAR}={n}")


def driver_limit() -> Limit:
    """What the driver may plan to hold: ``RAYLANE_MEMORY_BUDGET_BYTES``, else 80% of the
    memory available on this machine now."""
    if (given := _override()) is not None:
        return given
    import psutil

    avail = psutil.virtual_memory().available
    return Limit(int(avail * SAFETY), f"{SAFETY:.0%} of the {size(avail)} available on this machine; {ENV_VAR} overrides it")


def actor_limit() -> Limit:
    """What one actor may plan to hold: ``RAYLANE_MEMORY_BUDGET_BYTES``; else, in a process
    already connected to Ray, 80% of the largest node's memory; else as :func:`driver_limit`."""
    if (given := _override()) is not None:
        return given
    ray = sys.modules.get("ray")  # never imported here: a driver before Ray starts has no cluster to ask
    if ray is not None and ray.is_initialized():
        try:
            biggest = max(float(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive"))
        except (ValueError, KeyError, TypeError):  # no live node reported memory: fall back to this machine
            biggest = 0.0
        if biggest > 0:
            return Limit(int(biggest * SAFETY), f"{SAFETY:.0%} of the {size(biggest)} of the cluster's largest node; {ENV_VAR} overrides it")
    return driver_limit()


def _keys(estimates: Sequence[Estimate], attr: str) -> list[str]:
    out: list[str] = []
    for e in estimates:
        keys = getattr(e, attr)
        for k in (keys,) if isinstance(keys, str) else keys:
            if k not in out:
                out.append(k)
    return out


def _either(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f" or {keys[-1]}"


def what_to_change(estimates: Sequence[Estimate]) -> str:
    """``Lower a or b, or raise c``: the keys of the figures that matter (a tenth of the
    total or more), biggest first; a small figure's keys would send the reader the wrong way.

    >>> what_to_change([Estimate("x", 90, ("rows", "features")), Estimate("y", 5, "eval_rows", ("shards",))])
    'Lower rows or features'
    """
    total = sum(e.nbytes for e in estimates)
    big = [e for e in sorted(estimates, key=lambda e: -e.nbytes) if e.nbytes >= total / 10]
    lower, more = _keys(big, "keys"), _keys(big, "more")
    parts = ([f"Lower {_either(lower)}"] if lower else []) + ([f"raise {_either(more)}"] if more else [])
    return ", or ".join(parts) if parts else "Lower the sizes above"


def check(job: str, estimates: Sequence[Estimate], *, where: Literal["driver"] | str = "driver", limit: Limit | None = None) -> float:
    """Refuse ``estimates`` whose sum is above ``limit``; returns the sum in bytes.

    ``where`` is ``"driver"`` or the role of one actor (``"rollout worker"``); an actor's
    estimates are per actor, checked against :func:`actor_limit` by default. The error
    names the total, the limit and its source, each figure largest first, and the keys to
    lower in that order.

    >>> lim = Limit(4 * GiB, "a test limit")
    >>> check("demo", [Estimate("rows: rows (1000) x 8 bytes", 8000, "rows")], limit=lim)
    8000
    >>> try:
    ...     check("demo", [Estimate("rows: rows (10000000000) x 8 bytes", 8e10, "rows")], limit=lim)
    ... except BudgetError as e:
    ...     print(e)
    demo: the driver would need about 74.5 GiB, above its memory budget of 4.0 GiB (a test limit): rows: rows (10000000000) x 8 bytes = 74.5 GiB. Lower rows.
    """
    total = sum(e.nbytes for e in estimates)
    if limit is None:
        limit = driver_limit() if where == "driver" else actor_limit()
    if total <= limit.nbytes:
        return total
    ordered = sorted(estimates, key=lambda e: -e.nbytes)
    figures = "; ".join(f"{e.what} = {size(e.nbytes)}" for e in ordered if e.nbytes > 0)
    who = "the driver would need" if where == "driver" else f"each {where} (per actor) would need"
    budget = "its memory budget" if where == "driver" else "the per-actor memory budget"
    raise BudgetError(f"{job}: {who} about {size(total)}, above {budget} of {size(limit.nbytes)} ({limit.source}): {figures}. {what_to_change(estimates)}.")


def check_count(job: str, what: str, value: int, bound: int, formula: str, keys: Sequence[str], why: str) -> None:
    """Refuse a count (samples per fragment, ...) above a sanity ``bound`` that would make
    a step take far longer than anyone meant, whatever the memory.

    >>> check_count("demo", "samples per fragment", 10, 100, "a (2) x b (5)", ["a", "b"], "too slow")
    >>> try:
    ...     check_count("demo", "samples per fragment", 1000, 100, "a (20) x b (50)", ["a", "b"], "too slow")
    ... except BudgetError as e:
    ...     print(e)
    demo: a (20) x b (50) = 1,000 samples per fragment, above the bound of 100 (too slow). Lower a or b.
    """
    if value <= bound:
        return
    raise BudgetError(f"{job}: {formula} = {value:,} {what}, above the bound of {bound:,} ({why}). Lower {_either(list(keys))}.")
