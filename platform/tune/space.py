"""Search spaces for ``raylane tune``: specs written as text, checked against a job's config.

A spec is one of ``uniform(low, high)``, ``loguniform(low, high)``, ``randint(low, high)``
(both ends included), ``choice([a, b, ...])`` or ``grid([a, b, ...])``. Arguments are read
with :func:`ast.literal_eval` (numbers, strings, lists; nothing that runs code). A space is
``{dotted key: spec}``, from ``--search key=SPEC`` or from a YAML mapping (nested mappings
flatten to dotted keys). :func:`check_space` refuses, before Ray starts, a key the job's
config does not have (with a did-you-mean), a spec that does not parse, a range whose low
is not below its high, and values the key's type or bounds would refuse. Ray Tune does
the sampling: :meth:`Spec.to_tune` gives its domain objects.
"""

from __future__ import annotations

import ast
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from raylane import config as cfg

KINDS = ("uniform", "loguniform", "randint", "choice", "grid")
_SPEC = re.compile(r"^\s*([A-Za-z_]+)\s*\((.*)\)\s*$", re.S)


class SearchSpaceError(ValueError):
    """A search space the job cannot take; the message names the key and the spec."""


@dataclass(frozen=True)
class Spec:
    """One key's search: its kind and arguments."""

    kind: str
    """One of :data:`KINDS`."""
    args: tuple
    """(low, high) for ranges; (values,) for choice and grid."""
    text: str
    """The spec as written."""

    @property
    def values(self) -> list:
        """The values a trial may get (choice, grid) or the ends of the range."""
        return list(self.args[0]) if self.kind in ("choice", "grid") else [self.args[0], self.args[1]]

    def to_tune(self) -> Any:
        """Ray Tune's domain for this spec."""
        from ray import tune

        if self.kind == "uniform":
            return tune.uniform(*self.args)
        if self.kind == "loguniform":
            return tune.loguniform(*self.args)
        if self.kind == "randint":  # Tune's upper bound is exclusive; ours is included
            return tune.randint(self.args[0], self.args[1] + 1)
        if self.kind == "choice":
            return tune.choice(list(self.args[0]))
        return tune.grid_search(list(self.args[0]))


def parse_spec(text: str, key: str = "?") -> Spec:
    """``loguniform(1e-4, 1e-2)`` -> Spec; SearchSpaceError naming the key and what is valid."""
    m = _SPEC.match(str(text))
    usage = "uniform(low, high), loguniform(low, high), randint(low, high), choice([a, b]) or grid([a, b])"
    if not m:
        raise SearchSpaceError(f"search {key}={text!r}: not a spec; write one of {usage} (a fixed value goes in --set)")
    kind, raw = m.group(1), m.group(2)
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SearchSpaceError(f"search {key}={text!r}: unknown spec {kind!r}{hint}; valid: {usage}")
    try:
        args = ast.literal_eval(f"({raw},)") if raw.strip() else ()
    except (ValueError, SyntaxError) as exc:
        raise SearchSpaceError(f"search {key}={text!r}: the arguments do not parse ({exc.__class__.__name__}); "
                               f"numbers, strings and lists only, e.g. {usage}") from None
    if kind in ("choice", "grid"):
        if len(args) != 1 or not isinstance(args[0], (list, tuple)) or not args[0]:
            raise SearchSpaceError(f"search {key}={text!r}: {kind} takes one non-empty list, e.g. {kind}([64, 128])")
        return Spec(kind, (tuple(args[0]),), text)
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise SearchSpaceError(f"search {key}={text!r}: {kind} takes two numbers, e.g. {kind}(1, 10)")
    low, high = args
    if not all(math.isfinite(a) for a in args):
        raise SearchSpaceError(f"search {key}={text!r}: the bounds must be finite numbers")
    if low >= high:
        raise SearchSpaceError(f"search {key}={text!r}: low ({low}) must be below high ({high})")
    if kind == "loguniform" and low <= 0:
        raise SearchSpaceError(f"search {key}={text!r}: loguniform needs 0 < low; use uniform for ranges that reach 0")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise SearchSpaceError(f"search {key}={text!r}: randint takes whole numbers; use uniform for fractions")
    return Spec(kind, (low, high), text)


def parse_search(items: list[str]) -> dict[str, Spec]:
    """``["lr=loguniform(1e-4,1e-2)", ...]`` (the ``--search`` options) -> {key: Spec}."""
    space: dict[str, Spec] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SearchSpaceError(f"--search {item!r}: expected key=SPEC, e.g. lr=loguniform(1e-4,1e-2)")
        if key in space:
            raise SearchSpaceError(f"--search {key!r} is given twice")
        space[key] = parse_spec(text, key)
    return space


def space_from_mapping(data: Mapping[str, Any], prefix: str = "") -> dict[str, Spec]:
    """A YAML search space: {key: spec text}, nested mappings flattened to dotted keys."""
    if not isinstance(data, Mapping):
        raise SearchSpaceError(f"a search space is a mapping of keys to specs, got {type(data).__name__}")
    out: dict[str, Spec] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(space_from_mapping(v, key))
        else:
            out[key] = parse_spec(v, key)
    return out


def check_space(config_cls: type, space: Mapping[str, Spec], base: Mapping[str, Any] | None = None) -> None:
    """Every key exists in the job's config and every value a trial could get is one the
    key takes (a range is checked at both ends). ``base``: keys fixed by --set, which a
    search must not also vary."""
    if not space:
        raise SearchSpaceError("the search space is empty: give at least one --search key=SPEC (or a search: mapping)")
    rows = cfg.describe(config_cls)
    keys = [row[0] for row in rows]
    free = [row[0] for row in rows if row[1].startswith("dict")]  # free-form mappings: any key under them
    for key, spec in space.items():
        if key not in keys and not any(key.startswith(f + ".") and len(key) > len(f) + 1 for f in free):
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(keys)}"
            raise SearchSpaceError(f"search key {key!r} is not a key of {config_cls.__name__}{hint}")
        if base and key in base:
            raise SearchSpaceError(f"{key!r} is both fixed (--set) and searched (--search); drop one")
        for value in spec.values:
            try:
                cfg.check_value(config_cls, key, value)
            except (cfg.ConfigError, ValueError, TypeError) as exc:
                raise SearchSpaceError(f"search {key}={spec.text!r}: {value!r} is not a value {key!r} takes: {exc}") from None
        if spec.kind in ("uniform", "loguniform"):  # a fraction must be a value the key takes
            probe = (spec.args[0] + spec.args[1]) / 2
            try:
                got = cfg.check_value(config_cls, key, probe)
            except (cfg.ConfigError, ValueError, TypeError) as exc:
                raise SearchSpaceError(f"search {key}={spec.text!r}: {key!r} does not take fractions such as {probe!r} "
                                       f"(it takes whole numbers: use randint or choice): {exc}") from None
            if isinstance(got, int) and not isinstance(got, bool):
                raise SearchSpaceError(f"search {key}={spec.text!r}: {key!r} takes whole numbers; use randint or choice")


def nest(values: Mapping[str, Any]) -> dict:
    """``{"driver.max_steps": 5}`` -> ``{"driver": {"max_steps": 5}}``."""
    out: dict = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"driver": {"max_steps": 5}}`` -> ``{"driver.max_steps": 5}``."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def trial_config(spec: Any, values: Mapping[str, Any], config_file: str | None, overrides: list[str] | tuple = ()) -> Any:
    """One trial's config (``spec``: the job's :class:`~raylane.registry.JobSpec`, as
    :func:`raylane.prepare.job_config` assembles every run's): the job's defaults <- the config file <- the trial's sampled
    ``values`` (typed, never round-tripped through text) <- ``--set`` overrides. A sampled
    value wins over the file's value of the same key (the search says so before it starts);
    a key both --set and searched is refused by :func:`check_space`."""
    from raylane.prepare import job_config

    return job_config(spec, cfg.merge(cfg.read_mapping(config_file), nest(values)), overrides=overrides)


def trial_count(space: Mapping[str, Spec], num_samples: int) -> int:
    """Trials Tune will run: num_samples times the product of the grid sizes."""
    n = num_samples
    for spec in space.values():
        if spec.kind == "grid":
            n *= len(spec.args[0])
    return n
