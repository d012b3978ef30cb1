"""The best a run has reached on one metric, and when it has stopped improving: which
metric (``driver.best_metric``, default the job's main metric) and whether higher is better
(``driver.best_mode``, by default read from the metric's name), checked against what the job
reports before Ray starts; then, step by step, whether an evaluation improved on the best
by more than ``driver.early_stop_min_delta`` and whether ``driver.early_stop_patience``
evaluations went by without one. Pure: the driver (:mod:`raylane.driver`) acts on the
verdicts, and :mod:`raylane.best_store` keeps the best checkpoint.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict, dataclass
from typing import Any

_MAX = re.compile(r"(acc|auc|return|reward|score|f1|precision|recall|per_s|throughput)", re.I)
_MIN = re.compile(r"(loss|error|rmse|mae|logloss|perplexity|regret|_s$)", re.I)
MODES = ("auto", "max", "min")


def metric_mode(metric: str) -> str | None:
    """``max`` for returns, accuracies, AUCs, rates; ``min`` for losses and errors; None when the name says neither.

    >>> metric_mode("valid-auc"), metric_mode("val_loss"), metric_mode("clock")
    ('max', 'min', None)
    """
    if _MAX.search(metric):
        return "max"
    return "min" if _MIN.search(metric) else None


@dataclass(frozen=True)
class Rule:
    """What "best" means for one run."""

    metric: str
    """The metric compared."""
    mode: str
    """``max`` (higher is better) or ``min``."""
    min_delta: float = 0.0
    """An evaluation improves only when it beats the best by more than this."""
    patience: int = 0
    """Evaluations in a row without an improvement that end the run; 0: never."""
    keep: bool = False
    """Keep the best checkpoint apart from the rotation."""

    def better(self, value: float, than: float | None, min_delta: float | None = None) -> bool:
        """Whether ``value`` improves on ``than`` by more than ``min_delta`` (default: the rule's)."""
        if than is None:
            return True
        delta = self.min_delta if min_delta is None else min_delta
        return value > than + delta if self.mode == "max" else value < than - delta

    def describe(self) -> str:
        return f"{self.metric} ({'higher' if self.mode == 'max' else 'lower'} is better)"


def rule_for(driver: Any, workload: Any) -> Rule | None:
    """The run's :class:`Rule` from its driver config (None when neither ``keep_best`` nor
    ``early_stop_patience`` asks for one). A metric the job does not report, or a mode the
    name does not tell, is a ``ValueError`` naming the key, the value and what is valid."""
    if not (driver.keep_best or driver.early_stop_patience):
        return None
    metric = driver.best_metric or workload.main_metric
    declared = tuple(getattr(workload, "metrics", ()) or ())
    if declared and metric not in declared:
        raise ValueError(f"driver.best_metric={metric!r}: job {workload.name!r} does not report it; it reports {', '.join(declared)}")
    if driver.best_mode not in MODES:
        raise ValueError(f"driver.best_mode={driver.best_mode!r}: use one of {', '.join(MODES)}")
    mode = metric_mode(metric) if driver.best_mode == "auto" else driver.best_mode
    if mode is None:
        raise ValueError(f"driver.best_metric={metric!r}: its name does not say whether higher is better; set driver.best_mode=max or min")
    return Rule(metric, mode, float(driver.early_stop_min_delta), int(driver.early_stop_patience), bool(driver.keep_best))


@dataclass(frozen=True)
class Verdict:
    """What one step's metrics mean for the best."""

    evaluated: bool = False
    """The step reported the metric (a finite number)."""
    improved: bool = False
    """It beat the best so far (the first evaluation always does): the checkpoint to keep.
    Patience counts improvements by more than ``min_delta`` only."""
    stop: str = ""
    """Why the run ends here (patience ran out); empty to go on."""


@dataclass
class Best:
    """The best so far under a :class:`Rule`; its :meth:`state` travels with every checkpoint,
    so a run that rolls back or resumes counts patience exactly as one that never stopped."""

    rule: Rule
    value: float | None = None
    """The best evaluation so far (what ``keep_best`` keeps)."""
    step: int | None = None
    evaluations: int = 0
    reference: float | None = None
    """The evaluation patience counts from: the last that beat the one before it by more than ``min_delta``."""
    since: int = 0
    """Evaluations since the reference."""

    def see(self, step: int, metrics: dict[str, Any]) -> Verdict:
        """Step ``step``'s metrics (steps count from 1, as the run's log does)."""
        raw = metrics.get(self.rule.metric)
        if isinstance(raw, bool) or not isinstance(raw, numbers.Real) or not math.isfinite(raw):
            return Verdict()
        value = float(raw)
        self.evaluations += 1
        improved = self.rule.better(value, self.value, min_delta=0.0)
        if improved:
            self.value, self.step = value, step
        if self.rule.better(value, self.reference):
            self.reference, self.since = value, 0
            return Verdict(evaluated=True, improved=improved)
        self.since += 1
        if self.rule.patience and self.since >= self.rule.patience:
            delta = f" by more than {self.rule.min_delta:g}" if self.rule.min_delta else ""
            return Verdict(evaluated=True, improved=improved,
                           stop=(f"early stop: {self.rule.metric} did not improve{delta} in {self.since} evaluations "
                                 f"(driver.early_stop_patience={self.rule.patience}); best {self.value:.6g} at step {self.step}"))
        return Verdict(evaluated=True, improved=improved)

    def state(self) -> dict[str, Any]:
        return {"metric": self.rule.metric, "mode": self.rule.mode, "value": self.value, "step": self.step,
                "evaluations": self.evaluations, "reference": self.reference, "since": self.since}

    def load(self, state: dict[str, Any] | None) -> None:
        """The state a checkpoint carried; one of another metric or mode (the run was resumed
        with another rule) or none (written before the rule existed) starts the count over."""
        if not state or state.get("metric") != self.rule.metric or state.get("mode") != self.rule.mode:
            self.value, self.step, self.evaluations, self.reference, self.since = None, None, 0, None, 0
            return
        self.value, self.step = state["value"], state["step"]
        self.reference = state.get("reference", state["value"])
        self.evaluations, self.since = int(state["evaluations"]), int(state["since"])

    def summary(self) -> dict[str, Any]:
        return {**asdict(self.rule), "value": self.value, "step": self.step, "evaluations": self.evaluations}
