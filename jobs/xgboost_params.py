"""The xgboost params of ``raylane run xgboost``, settled on the driver before Ray starts.

Pure functions over the user's ``params`` and a :class:`~raylane.actors.tabular.LabelSummary`:

* :func:`static_params` refuses names xgboost does not know (naming the nearest valid ones),
  keys that have a config field of their own, NaN and infinite values, and objectives
  this job does not train;
* :func:`objective_params` picks the objective from the labels when none is given (and says
  why, in an :class:`ObjectiveChoice`), checks a given one against them, and fills in
  ``num_class`` and ``eval_metric``;
* :func:`probe` trains one round on two rows, so that xgboost refuses a bad value here
  rather than on every trainer.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from raylane import config as cfg
from raylane.actors.tabular import LabelSummary

log = logging.getLogger(__name__)

# Objectives whose rows are (features, label); ranking and survival need fields this job does not read.
OBJECTIVES = (
    "binary:logistic", "binary:logitraw", "binary:hinge",
    "multi:softprob", "multi:softmax",
    "reg:squarederror", "reg:squaredlogerror", "reg:logistic", "reg:pseudohubererror",
    "reg:absoluteerror", "reg:quantileerror", "reg:gamma", "reg:tweedie", "count:poisson",
)
DEFAULT_PARAMS = {"tree_method": "hist", "max_depth": 6, "eta": 0.3, "seed": 0}
# Objectives that need labels above a bound: (bound, whether the bound itself is refused).
LABEL_FLOORS = {"count:poisson": (0.0, False), "reg:tweedie": (0.0, False), "reg:gamma": (0.0, True), "reg:squaredlogerror": (-1.0, True)}
DEFAULT_METRICS = {"binary": ["logloss", "auc"], "multi": ["mlogloss", "merror"], "reg": ["rmse"]}
# Keys that have a config field of their own, so there is one place to set them.
OWN_FIELDS = {"nthread": "threads", "n_jobs": "threads", "num_boost_round": "num_boost_round", "n_estimators": "num_boost_round"}
# Whole-number labels 0..k-1 with more classes than this are read as a quantity, not classes.
MAX_CLASSES = 100
# Parameters xgboost.train takes that a Booster's saved config does not list as a key of
# their own: eval_metric is kept as a list of metrics, verbosity in the global config.
NOT_IN_CONFIG = ("eval_metric", "verbosity")
# Params an objective needs before a Booster with it can be configured at all.
_NEEDS = {"multi:softprob": {"num_class": 3}, "multi:softmax": {"num_class": 3}, "reg:quantileerror": {"quantile_alpha": 0.5}}


@dataclass(frozen=True)
class ObjectiveChoice:
    """The objective a run trains and why: shown as the run starts and in ``events.jsonl``."""

    objective: str
    inferred: bool
    """Chosen from the labels (params gave no objective)."""
    reason: str
    """Why, in words: what the labels are, or that params set it."""
    num_class: int | None
    labels: LabelSummary

    def line(self, metrics: tuple[str, ...]) -> str:
        """One line for the terminal.

        >>> ObjectiveChoice("reg:squarederror", False, "set in params", None, LabelSummary(0.0, 1.5, False, False)).line(("rmse",))
        'xgboost: objective reg:squarederror (set in params); eval_metric rmse'
        """
        what = self.objective + (f", num_class={self.num_class}" if self.num_class else "")
        how = f"chosen from the labels: {self.reason}; set params.objective to choose another" if self.inferred else self.reason
        return f"xgboost: objective {what} ({how}); eval_metric {', '.join(metrics)}"

    def event(self, metrics: tuple[str, ...]) -> dict[str, Any]:
        """The fields of the ``xgboost_objective`` event."""
        lab = self.labels
        labels = {"min": lab.minimum, "max": lab.maximum, "binary": lab.binary, "whole": lab.integral, "distinct": lab.distinct}
        return {"objective": self.objective, "inferred": self.inferred, "reason": self.reason, "num_class": self.num_class, "eval_metric": list(metrics), "labels": labels}


# ---------------------------------------------------------------- parameter names


@lru_cache(maxsize=1)
def known_params() -> frozenset[str]:
    """Every training parameter the installed xgboost knows for the objectives and boosters
    this job can train, aliases included (eta and learning_rate, lambda and reg_lambda).

    Read from the saved configuration of one Booster per booster and objective
    (``Booster.save_config`` lists each parameter of the parts that Booster uses), plus
    :data:`NOT_IN_CONFIG`. Empty when the configuration cannot be read as expected (a future
    xgboost): the names are then left to xgboost's own "not used" warning.
    """
    import numpy as np
    import xgboost as xgb

    rows = xgb.DMatrix(np.zeros((3, 1), dtype=np.float32), np.array([0.0, 1.0, 2.0], dtype=np.float32))
    names = set(NOT_IN_CONFIG)
    try:
        for booster in ("gbtree", "dart", "gblinear"):
            # gblinear's coordinate descent has a parameter (top_k) its default updater lacks.
            extra = {"updater": "coord_descent"} if booster == "gblinear" else {}
            for objective in OBJECTIVES:
                params = {"booster": booster, "objective": objective, **_NEEDS.get(objective, {}), **extra}
                _leaf_keys(json.loads(xgb.Booster(params, [rows]).save_config()), names)
    except (xgb.core.XGBoostError, ValueError, TypeError) as exc:
        log.warning("xgboost: could not read the parameter names of xgboost %s (%s); unknown params are not refused", xgb.__version__, exc)
        return frozenset()
    if not {"max_depth", "eta", "objective", "seed", "num_class"} <= names:
        log.warning("xgboost: the saved config of xgboost %s does not look as expected; unknown params are not refused", xgb.__version__)
        return frozenset()
    return frozenset(names)


def _leaf_keys(node: Any, out: set[str], key: str | None = None) -> None:
    """The keys of a saved config whose values are parameter values (strings); a component's
    ``name`` (the objective or updater it is) is not a parameter."""
    if isinstance(node, dict):
        for k, v in node.items():
            _leaf_keys(v, out, k)
    elif isinstance(node, list):
        for v in node:
            _leaf_keys(v, out, key)
    elif isinstance(node, str) and key is not None and key != "name":
        out.add(key)


def check_names(user: dict[str, Any]) -> None:
    """Refuse keys xgboost does not know, and known keys with no value (xgboost drops those
    silently). One :class:`ConfigError` names every bad key, with the nearest valid names."""
    known = known_params()
    if not known:
        return
    problems = []
    for key, value in user.items():
        key = str(key)
        if key not in known:
            problems.append(_unknown(key, value, known))
        elif value is None:
            problems.append(f"params.{key}: no value (YAML reads `{key}:` with nothing after it, or `~`, as none); give a value or leave the key out")
    if problems:
        raise cfg.ConfigError("; ".join(problems))


def check_finite(user: dict[str, Any]) -> None:
    """Refuse NaN and infinite numbers (``params.eta=.nan``), also inside a list value:
    xgboost takes them and trains a model that predicts NaN."""
    for key, value in user.items():
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            cfg.check_finite(item, f"params.{key}" if i is None else f"params.{key}[{i}]")


def _unknown(key: str, value: Any, known: frozenset[str]) -> str:
    head, colon, tail = key.partition(":")
    if colon and value is None:
        # YAML reads {objective:nosuch} as one key 'objective:nosuch' with no value.
        if key in OBJECTIVES or head in {o.split(":")[0] for o in OBJECTIVES}:
            return f"params: {key!r} is given as a key with no value; to train with this objective write {{objective: {key}}} (or --set params.objective={key})"
        if head in known:
            return f"params: {key!r} looks like `{head}: {tail}` missing a space after the colon (YAML then reads one key, {key!r}, with no value); write {{{head}: {tail}}}"
    import xgboost as xgb

    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    if close:
        others = f" (also near: {', '.join(close[1:])})" if close[1:] else ""
        return f"params.{key}: xgboost {xgb.__version__} has no parameter {key!r}; did you mean {close[0]}?{others}"
    return f"params.{key}: xgboost {xgb.__version__} has no parameter {key!r}; its parameters are: {', '.join(sorted(known))}"


def static_params(user: dict[str, Any]) -> dict[str, Any]:
    """The user's params over :data:`DEFAULT_PARAMS`, with every name and the objective checked
    (what needs no data)."""
    for key, own in OWN_FIELDS.items():
        if key in user:
            raise cfg.ConfigError(f"params.{key}: set {own} instead (it has its own field)")
    check_names(user)
    check_finite(user)
    params = {**DEFAULT_PARAMS, **user}
    objective = params.get("objective")
    if objective is not None and objective not in OBJECTIVES:
        close = difflib.get_close_matches(str(objective), OBJECTIVES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise cfg.ConfigError(f"params.objective: unknown objective {objective!r}.{hint} Valid objectives: {', '.join(OBJECTIVES)}")
    if params["tree_method"] == "auto":
        params["tree_method"] = "hist"
    if params["tree_method"] not in ("hist", "approx"):
        raise cfg.ConfigError(f"params.tree_method: {params['tree_method']!r} does not train distributed; use 'hist' (default) or 'approx'")
    return params


# ---------------------------------------------------------------- the objective


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}"


def class_count(labels: LabelSummary) -> int | None:
    """k when the labels are exactly the class indices 0..k-1, each present; else None.

    >>> class_count(LabelSummary(0.0, 2.0, False, True, 3)), class_count(LabelSummary(1.0, 3.0, False, True, 3))
    (3, None)
    """
    if not labels.integral or labels.distinct is None or labels.minimum != 0:
        return None
    return labels.distinct if labels.maximum == labels.distinct - 1 else None


def infer_objective(labels: LabelSummary, num_class: Any = None) -> tuple[str, str]:
    """The objective for these labels when params name none, and why in words.

    binary:logistic when every label is 0 or 1; multi:softprob when the labels are exactly
    the whole numbers 0..k-1, each present, with k <= :data:`MAX_CLASSES` (or when params
    give num_class); otherwise reg:squarederror, whole numbers included (counts, years,
    ratings 1..5), with the reason they were not taken for classes.

    >>> infer_objective(LabelSummary(0.0, 2.0, False, True, 3))
    ('multi:softprob', 'class indices 0..2, 3 classes')
    >>> infer_objective(LabelSummary(1.0, 5.0, False, True, 5))
    ('reg:squarederror', 'whole numbers 1..5, not class indices 0..k-1 as the smallest is 1')
    """
    if num_class is not None:
        return "multi:softprob", f"params.num_class is {num_class}"
    if labels.binary:
        return "binary:logistic", "every label is 0 or 1"
    k = class_count(labels)
    if k is not None and k <= MAX_CLASSES:
        return "multi:softprob", f"class indices 0..{k - 1}, {k} classes"
    lo, hi = _num(labels.minimum), _num(labels.maximum)
    if not labels.integral:
        return "reg:squarederror", "not all whole numbers"
    if k is not None:
        return "reg:squarederror", f"whole numbers 0..{hi}: more than {MAX_CLASSES} classes, so read as a quantity"
    if labels.minimum != 0:
        return "reg:squarederror", f"whole numbers {lo}..{hi}, not class indices 0..k-1 as the smallest is {lo}"
    seen = "" if labels.distinct is None else f": only {labels.distinct} of the {int(labels.maximum) + 1} values occur"
    return "reg:squarederror", f"whole numbers 0..{hi} with gaps{seen}, not class indices 0..k-1"


def _label_words(labels: LabelSummary) -> str:
    k = class_count(labels)
    span = f"[{_num(labels.minimum)}, {_num(labels.maximum)}]"
    return f"{span} (the class indices 0..{k - 1}: {k} classes)" if k else span


def objective_params(params: dict[str, Any], labels: LabelSummary, column: str = "label") -> tuple[dict[str, Any], ObjectiveChoice]:
    """``params`` with the objective (chosen from the labels when not given), num_class and
    eval_metric filled in, and the choice; a given objective the labels do not fit is refused,
    and so is any classification of a label ``column`` that holds one value only."""
    params = dict(params)
    given = params.get("objective")
    if given is None:
        objective, reason = infer_objective(labels, params.get("num_class"))
        params["objective"] = objective
    else:
        objective, reason = given, "set in params"
    family = objective.split(":")[0] if objective.split(":")[0] in ("binary", "multi") else "reg"
    lo, hi = labels.minimum, labels.maximum
    if family != "reg" and lo == hi:
        # A constant 0/1 label would be taken as binary: one class has nothing to tell apart
        # and the eval AUC is NaN on every round, so the run would finish without a word.
        how = f"chosen from the labels: {reason}" if given is None else "set in params"
        raise cfg.ConfigError(f"data.label: column {column!r} holds one value only ({_num(lo)}, every row), so {objective} ({how}) has "
                              f"nothing to classify and the eval AUC would be NaN; give data with at least two classes, or set "
                              f"params.objective to a regression objective (e.g. reg:squarederror)")
    if family == "binary" and not (lo >= 0 and hi <= 1):
        k = class_count(labels)
        fix = f"use multi:softprob for {k} classes" if k else "use a reg:* objective or recode the labels"
        raise cfg.ConfigError(f"params.objective: {objective} needs labels in [0, 1], but the labels span {_label_words(labels)}; {fix}, or leave params.objective unset to have it chosen from the labels")
    if family == "multi":
        if not labels.integral or lo < 0:
            raise cfg.ConfigError(f"params.objective: {objective} needs class labels 0..k-1, the labels span [{lo:g}, {hi:g}] and are {'whole' if labels.integral else 'not whole'} numbers")
        params.setdefault("num_class", int(hi) + 1)
        if not hi < params["num_class"]:
            raise cfg.ConfigError(f"params.num_class: {params['num_class']} classes, but the labels go up to {hi:g}; set num_class to at least {int(hi) + 1}")
    bound, strict = LABEL_FLOORS.get(objective, (-math.inf, False))
    if lo < bound or (strict and lo == bound):
        raise cfg.ConfigError(f"params.objective: {objective} needs labels {'>' if strict else '>='} {bound:g}, the smallest label is {lo:g}")
    params.setdefault("eval_metric", list(DEFAULT_METRICS[family]))
    num_class = int(params["num_class"]) if family == "multi" else None
    return params, ObjectiveChoice(objective, given is None, reason, num_class, labels)


def probe(params: dict[str, Any], labels: LabelSummary) -> tuple[str, ...]:
    """Train one round on two rows: xgboost refuses bad params here, and names its metrics."""
    import numpy as np
    import xgboost as xgb

    lo = labels.minimum if math.isfinite(labels.minimum) else 0.0
    hi = labels.maximum if math.isfinite(labels.maximum) else 1.0
    d = xgb.DMatrix(np.array([[0.0], [1.0]], dtype=np.float32), np.array([lo, hi], dtype=np.float32))
    history: dict = {}
    try:
        xgb.train({**params, "nthread": 1}, d, 1, evals=[(d, "probe")], evals_result=history, verbose_eval=False)
    except xgb.core.XGBoostError as exc:
        first = next((line for line in str(exc).splitlines() if line.strip() and "Stack trace" not in line), str(exc))
        raise cfg.ConfigError(f"params: xgboost refused {params}: {first.split(': ', 1)[-1]}") from None
    return tuple(history["probe"])
