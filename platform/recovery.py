"""Recovering from a failed step: the failure policy judges each failure (a failure while
recovering counts as another), and the run is rebuilt until it works or the policy gives up.
Every failure is a ``failure`` event with the policy's decision and reason."""

from __future__ import annotations

import time
from typing import Callable

from raylane.errors import is_recoverable
from raylane.policies import Decision, Failure, FailurePolicy
from raylane.runlog import RunLog


class Recovery:
    """The failures of one run and the policy that judges them."""

    def __init__(self, policy: FailurePolicy):
        self.policy = policy
        self.failures: list[Failure] = []
        self.recovered = 0

    def recover(self, exc: BaseException, step: int, rebuild: Callable[[BaseException], None], runlog: RunLog) -> tuple[Decision, BaseException] | None:
        """Judge ``exc`` and call ``rebuild(error)`` until it returns; None once recovered, or
        the decision to fail and the failure it was made on."""
        since: float | None = None  # None for the failure that starts this recovery
        while True:
            role = getattr(exc, "role", None) or "workload"
            self.failures.append(Failure(role, getattr(exc, "actor", "?"), f"{type(exc).__name__}: {exc}", step, time.time()))
            decision = self.policy.decide(self.failures, recoverable=is_recoverable(exc), recovering_since=since)
            since = self.failures[-1].at if since is None else since
            runlog.event("failure", step=step, role=role, actor=getattr(exc, "actor", None), error=str(exc)[:2000],
                         decision=decision.action, reason=decision.reason)
            if decision.action == "fail":
                return decision, exc
            try:
                rebuild(exc)
                self.recovered += 1
                return None
            except Exception as again:  # noqa: BLE001 - judged by the policy on the next turn
                exc = again
