"""The driver's decisions as small policies over frozen status data. No Ray here.

* :class:`FailurePolicy`: after a failure, recover or give up.
* :class:`ScalingPolicy`: target pool sizes as nodes join and leave.
* :func:`non_finite`: a guarded metric (a loss) that went NaN or infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Failure:
    """One failure the driver saw: which role, which actor, what it said, at which step."""

    role: str
    actor: str
    message: str
    step: int
    at: float


def group_errors(failures: Sequence[Failure]) -> str:
    """One paragraph per distinct error message, naming the actors that raised it.

    >>> print(group_errors([Failure("w", "#1", "boom", 3, 0.0), Failure("w", "#2", "boom", 3, 0.0)]))
    2x from w #1, w #2:
      boom
    """
    groups: dict[str, list[str]] = {}
    for f in failures:
        groups.setdefault(f.message.strip(), []).append(f"{f.role} {f.actor}")
    parts = []
    for message, who in groups.items():
        indented = "\n".join("  " + line for line in message.splitlines()[:30])
        parts.append(f"{len(who)}x from {', '.join(who)}:\n{indented}")
    return "\n".join(parts)


@dataclass(frozen=True)
class Decision:
    action: str  # "recover" or "fail"
    reason: str


@dataclass(frozen=True)
class FailurePolicy:
    """Recover until a role has failed more than its budget, then fail the run."""

    max_failures: int = 3
    """Failures (of any role) the run survives in total."""
    per_role: Mapping[str, int] = field(default_factory=dict)
    """Tighter budgets for some roles, e.g. ``{"learner": 1}``."""
    max_recovery_s: float = 600.0
    """Seconds one recovery may take, from the failure to a running job (rebuilding actors,
    waiting for room, reloading the checkpoint), before the run is FAILED; 0: no limit."""

    def __post_init__(self) -> None:
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {self.max_failures}")
        if not (self.max_recovery_s >= 0 and math.isfinite(self.max_recovery_s)):
            raise ValueError(f"max_recovery_s must be a finite number >= 0 (0: no limit), got {self.max_recovery_s}")
        for role, n in self.per_role.items():
            if n < 0:
                raise ValueError(f"per_role[{role!r}] must be >= 0, got {n}")

    def decide(self, failures: Sequence[Failure], *, recoverable: bool = True, recovering_since: float | None = None) -> Decision:
        """``recovering_since``: when the recovery under way began (the time of the failure
        that started it), or None when the run was running until this failure."""
        if not failures:
            return Decision("recover", "no failures")
        last = failures[-1]
        if not recoverable:
            return Decision("fail", f"not recoverable: {_headline(last.message)}")
        if recovering_since is not None and self.max_recovery_s and last.at - recovering_since > self.max_recovery_s:
            return Decision("fail", f"recovery did not succeed within max_recovery_s={self.max_recovery_s:g} s "
                                    f"({last.at - recovering_since:.0f} s since the failure at step {last.step}); "
                                    f"last error: {_headline(last.message)}")
        if len(failures) > self.max_failures:
            return Decision("fail", f"{len(failures)} failures exceed max_failures={self.max_failures}:\n{group_errors(failures)}")
        for role, budget in self.per_role.items():
            n = sum(1 for f in failures if f.role == role)
            if n > budget:
                return Decision("fail", f"role {role!r} failed {n} times, budget {budget}:\n{group_errors([f for f in failures if f.role == role])}")
        return Decision("recover", f"failure {len(failures)} of at most {self.max_failures}")


@dataclass(frozen=True)
class PoolView:
    """What the scaling policy needs to know about one pool."""

    role: str
    wanted: int  # the size the job (or the user, through `scale`) asked for
    target: int  # the size the pool is trying to hold now
    live: int  # actors alive: ready or starting
    lo: int
    hi: int
    fits_more: int  # actors of this role the cluster's free resources hold now


@dataclass(frozen=True)
class ScalingPolicy:
    """Keep each elastic pool at its wanted size where the cluster allows it.

    When nodes leave and a pool cannot be refilled (no room anywhere), its target drops
    to what survives, never below ``lo``, so the job runs on smaller instead of waiting.
    When nodes join, the target grows back toward the wanted size. Fixed-size roles
    (``lo == hi``) are left alone: their size is part of the job's maths, and losing one
    of their actors is a failure for the driver to recover, not a scaling decision.
    """

    grow: bool = True
    """Grow pools back toward their wanted size when capacity appears."""

    def targets(self, pools: Sequence[PoolView]) -> dict[str, int]:
        """New targets for the pools whose target should change."""
        out = {}
        for p in pools:
            if p.lo == p.hi:
                continue
            target = p.target
            if p.live < p.target and p.fits_more == 0:
                target = max(p.lo, p.live)
            elif self.grow and p.target < p.wanted and p.fits_more > 0:
                target = min(p.wanted, p.hi, p.target + p.fits_more)
            if target != p.target:
                out[p.role] = target
        return out


@dataclass
class PoolAutoscale:
    """Opt-in autoscaling of one elastic pool, between ``min`` and ``max`` actors."""

    role: str
    """The pool's role name (see ``raylane pools RUN``)."""
    min: int = 1
    """Never shrink below this many actors."""
    max: int = 4
    """Never grow beyond this many actors."""
    grow_when_waiting: float = 0.2
    """Grow when the pool's consumer spent more than this fraction of the recent steps waiting for it."""
    shrink_when_busy_below: float = 0.5
    """Shrink when the pool's actors were busy less than this fraction of the recent steps (and nobody waited for them)."""
    window_steps: int = 3
    """Steps averaged before a decision."""
    cooldown_s: float = 20.0
    """Seconds after a change before the next one (no flapping)."""

    def validate(self) -> None:
        if self.min < 1:
            raise ValueError(f"min={self.min}: an autoscaled pool keeps at least one actor")
        if self.max < self.min:
            raise ValueError(f"max={self.max} is below min={self.min}")
        if self.window_steps < 1:
            raise ValueError(f"window_steps={self.window_steps}: must be >= 1")
        for name in ("grow_when_waiting", "shrink_when_busy_below"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: a fraction in 0..1")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s={self.cooldown_s}: must be >= 0")


class Autoscaler:
    """Grow a starved pool, shrink an idle one, one actor at a time, with a cooldown.

    Fed once per step with, per role, the fraction of the step its consumer waited for
    the pool (``waited``: the learner waiting for samples, the trainer's prefetch queue
    running dry) and the fraction of the step its actors were busy (``busy``).
    """

    def __init__(self, specs: Sequence[PoolAutoscale]):
        self.specs = {s.role: s for s in specs}
        self._seen: dict[str, list[tuple[float, float]]] = {r: [] for r in self.specs}
        self._changed: dict[str, float] = {}

    def observe(self, role: str, waited: float, busy: float) -> None:
        spec = self.specs.get(role)
        if spec is None:
            return
        seen = self._seen[role]
        seen.append((min(1.0, max(0.0, waited)), min(1.0, max(0.0, busy))))
        del seen[: -spec.window_steps]

    def decide(self, role: str, target: int, *, now: float, can_grow: bool = True) -> tuple[int, str] | None:
        """A new target and its reason, or None to leave the pool as it is."""
        spec = self.specs.get(role)
        if spec is None:
            return None
        if target < spec.min or target > spec.max:
            return self._change(role, min(spec.max, max(spec.min, target)), f"target {target} outside autoscale range {spec.min}..{spec.max}", now)
        if now - self._changed.get(role, -math.inf) < spec.cooldown_s:
            return None
        seen = self._seen[role]
        if len(seen) < spec.window_steps:
            return None
        waited = sum(w for w, _ in seen) / len(seen)
        busy = sum(b for _, b in seen) / len(seen)
        if waited > spec.grow_when_waiting and target < spec.max and can_grow:
            return self._change(role, target + 1, f"consumer waited {waited:.0%} of the last {len(seen)} steps (> {spec.grow_when_waiting:.0%})", now)
        if waited <= spec.grow_when_waiting / 2 and busy < spec.shrink_when_busy_below and target > spec.min:
            return self._change(role, target - 1, f"actors busy {busy:.0%} of the last {len(seen)} steps (< {spec.shrink_when_busy_below:.0%}) and nobody waited", now)
        return None

    def _change(self, role: str, target: int, reason: str, now: float) -> tuple[int, str]:
        self._changed[role] = now
        self._seen[role] = []  # the new size needs its own observations
        return target, reason


def non_finite(metrics: dict[str, Any], guarded: Sequence[str]) -> tuple[str, float] | None:
    """The first guarded metric that is NaN or infinite, with its value (plain, numpy and
    0-d tensor numbers alike; a metric that is not a number is not judged).

    >>> non_finite({"loss": float("nan"), "lr": 0.1}, ["loss"])
    ('loss', nan)
    """
    for key in guarded:
        try:
            value = float(metrics.get(key))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):
            return key, value
    return None


def _headline(message: str) -> str:
    """The first line of an error, and the one after it when the first only introduces
    it ("2 calls of 'train' on shard 0, shard 1 raised:")."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return "?"
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
