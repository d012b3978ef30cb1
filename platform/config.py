"""Typed job configuration: dataclasses in, validated instances out.

Model
-----
A job's config is a (possibly nested) ``@dataclass``. Each field carries its
type annotation, a default, optional constraints (``field(2, ge=1)``,
``field("a", choices=(...))``) and a docstring: the string literal written on
the line after the field, read back with ``ast`` (``field_docs``) for CLI help.

Values arrive in layers, each overriding the previous one::

    class defaults <- data (nested dict) <- YAML file <- --set a.b.c=value ...

The merged nested dict is then built into instances (``from_dict``): every
value is coerced by its annotation (strictly: ``"2"`` is not an int, ``True``
is not an int), nested mappings become nested dataclasses, unknown keys are
refused with a "did you mean", and constraints are checked. Finally each
dataclass' own ``validate(self)`` hook runs for cross-field rules. Every error
is a ``ConfigError`` naming the dotted key (``sampler.fanouts[1]``), so a bad
value stops a job before any Ray actor is started.

YAML is read by :mod:`raylane.config_yaml`; floats must be finite unless ``field(..., finite=False)``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import numbers
import operator
import re
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, Literal, TypeVar, Union

import yaml

from raylane.config_yaml import ConfigLoader, YAMLRefused, safe_load  # noqa: F401 - ConfigLoader is part of this module's surface

MISSING = dataclasses.MISSING
T = TypeVar("T")

__all__ = ["ConfigError", "ConfigLoader", "field", "field_docs", "from_dict", "to_dict", "load_config", "merge",
           "read_mapping", "parse_override", "validate", "describe", "check_finite", "MISSING"]


class ConfigError(ValueError):
    """A configuration value or file was refused; the message names the dotted key."""


_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
           "le": (operator.le, "<="), "lt": (operator.lt, "<")}
# PyYAML resolves YAML 1.1 floats, which need a dot: `lr: 1e-3` loads as the
# string "1e-3". Float fields accept exactly that shape so users are not bitten.
_SCI_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def field(default: Any = MISSING, *, default_factory: Any = MISSING, ge: float | None = None,
          gt: float | None = None, le: float | None = None, lt: float | None = None,
          choices: Sequence[Any] | None = None, finite: bool = True) -> Any:
    """dataclasses.field with constraints stored in metadata (ge/gt/le/lt numeric bounds,
    choices: a tuple of allowed values, finite=False: NaN and infinities are accepted, for
    a field whose docstring says what they mean)."""
    meta: dict[str, Any] = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if not finite:
        meta["finite"] = False
    # dataclasses refuses unhashable (mutable) defaults; `field([10, 5])` reads
    # better than a lambda, so turn it into a factory handing out fresh copies.
    if default is not MISSING and type(default).__hash__ is None:
        default, default_factory = MISSING, functools.partial(copy.deepcopy, default)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@functools.cache
def _own_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # builtins, exec'd code, REPL classes
        return {}
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)), None)
    body = node.body if node else []
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> docstring, read with `ast` from the class source (the string literal after the annotated assignment)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # bases first, so subclasses can re-document
        docs.update(_own_docs(klass))
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward refs (e.g. classes local to a function)
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _tname(tp: Any) -> str:
    """Readable type text: `list[int]`, `str | None`, `Literal['a', 'b']`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(map(_tname, args))
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if args:
        return f"{_tname(origin)}[{', '.join('...' if a is Ellipsis else _tname(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(value: Any, tp: Any, path: str) -> ConfigError:
    hint = "; quote it to pass a string" if tp is str and isinstance(value, (int, float)) else ""
    return ConfigError(f"{path}: expected {_tname(tp)}, got {value!r} ({type(value).__name__}){hint}")


def _is_choice(value: Any, choices: Sequence[Any]) -> bool:
    # `True == 1`, so compare bool-ness too or `True` would pass for choices (1, 2).
    return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices)


def _not_one_of(value: Any, choices: Sequence[Any], path: str) -> ConfigError:
    return ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, choices))}")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check/convert one raw value against annotation `tp`; raise ConfigError naming `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object or isinstance(tp, (str, TypeVar)):
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # Optional[X]: X's own error is the most precise one
            return _coerce(value, members[0], path)
        for member in members:
            try:
                return _coerce(value, member, path)
            except ConfigError:
                continue
        raise _type_error(value, tp, path)
    if origin is Literal:
        if _is_choice(value, args):
            return value
        raise _not_one_of(value, args, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _build(tp, value, path)
        raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r} ({type(value).__name__})")
    container = origin or tp
    if container in (list, tuple, set, frozenset, Sequence):
        if not isinstance(value, (list, tuple)):
            raise _type_error(value, tp, path)
        if container is tuple and args and args[-1] is not Ellipsis:  # fixed-length tuple[A, B]
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} items for {_tname(tp)}, got {len(value)}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = [_coerce(v, args[0] if args else Any, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if container in (list, Sequence) else container(items)
    if container is dict:
        if not isinstance(value, Mapping):
            raise _type_error(value, tp, path)
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, f"{path}.{k}"): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _SCI_FLOAT.match(value.strip()):
            return float(value)
    elif isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value  # an exotic typing construct: trust the dataclass itself
    raise _type_error(value, tp, path)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _check_field(f: dataclasses.Field, tp: Any, value: Any, path: str) -> None:
    """Metadata bounds/choices (and a Literal annotation); sequences are checked per element."""
    meta = f.metadata
    choices = meta.get("choices")
    if choices is None:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        lit = tp if typing.get_origin(tp) is Literal else (inner[0] if len(inner) == 1 else None)
        choices = typing.get_args(lit) if typing.get_origin(lit) is Literal else None
    seq = isinstance(value, (list, tuple))
    targets = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if seq else [(path, value)]
    for p, v in targets:
        if v is None:
            continue
        if meta.get("finite", True):
            check_finite(v, p, _bounds_text(meta))
        if choices is not None and not _is_choice(v, choices):
            raise _not_one_of(v, choices, p)
        for key, (op, sym) in _BOUNDS.items():
            if key in meta and not op(v, meta[key]):
                raise ConfigError(f"{p}: must be {sym} {meta[key]!r}, got {v!r}")


def _bounds_text(meta: Mapping[str, Any]) -> str:
    return " and ".join(f"{sym} {meta[key]!r}" for key, (_, sym) in _BOUNDS.items() if key in meta)


def check_finite(value: Any, path: str, bounds: str = "") -> None:
    """Refuse a NaN or infinite float ``value`` (``.nan``/``.inf`` in YAML) at dotted ``path``;
    other values pass. A NaN compares false with every bound, and an infinity passes a lower
    one, so without this ``lr=.inf`` would reach the learner."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
        within = f" {bounds}" if bounds else ""
        raise ConfigError(f"{path}: must be a finite number{within}, got {value!r}; NaN and infinities are refused here")


def _wrap(path: str, exc: Exception) -> ConfigError:
    return ConfigError(f"{path}: {exc}" if path else str(exc))


def _build(cls: type[T], data: Mapping[str, Any], path: str, base: Any = None) -> T:
    """Instantiate `cls` from a mapping. `base` is the parent's default instance, whose
    values (not the class defaults) fill keys the mapping leaves out."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            valid = [_join(path, k) for k in fields]
            close = difflib.get_close_matches(_join(path, str(key)), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ";"
            raise ConfigError(f"unknown key {_join(path, str(key))!r} for {cls.__name__}{hint} "
                              f"valid keys: {', '.join(valid)}")
    hints, kwargs = _hints(cls), {}
    for name, f in fields.items():
        p = _join(path, name)
        if name in data:
            value = data[name]
            default = None
            if isinstance(value, Mapping):  # only then can a default instance matter; skip factories otherwise
                default = _default(f) if base is None else getattr(base, name)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                # a partial mapping updates the default instance, keeping its non-class defaults
                kwargs[name] = _build(type(default), value, p, base=default)
            else:
                kwargs[name] = _coerce(value, hints[name], p)
            _check_field(f, hints[name], kwargs[name], p)
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"missing required key {p!r} for {cls.__name__}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ checks
        raise _wrap(path, exc) from exc


def validate(cfg: Any, prefix: str = "") -> None:
    """Check metadata constraints recursively, then each dataclass' own `validate(self)` hook."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, p = getattr(cfg, f.name), _join(prefix, f.name)
        _check_field(f, hints.get(f.name, Any), value, p)
        _validate_nested(value, p)
    hook = getattr(type(cfg), "validate", None)
    if callable(hook):
        try:
            hook(cfg)
        except ValueError as exc:  # ConfigError included: add this level's key path
            raise _wrap(prefix, exc) from exc


def _validate_nested(value: Any, path: str) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        validate(value, path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _validate_nested(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _validate_nested(v, f"{path}.{k}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build `cls` from a nested mapping (coercing types), then validate it."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass type")
    cfg = _build(cls, data, prefix)
    validate(cfg, prefix)
    return cfg


def check_value(cls: type, key: str, value: Any) -> Any:
    """The value dotted ``key`` of ``cls`` takes from ``value`` (coerced, its field's bounds
    checked; the class' own ``validate`` hook is not run). ConfigError names the key (with
    a did-you-mean for an unknown one) and the value."""
    nested: dict[str, Any] = {}
    node = nested
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    obj: Any = _build(cls, nested, "")
    for part in key.split("."):  # a key under a dict field (xgboost's params.eta) is an item of it
        obj = obj[part] if isinstance(obj, Mapping) else getattr(obj, part)
    return obj


def to_dict(cfg: Any) -> Any:
    """Plain nested dict/list/scalars (tuples become lists), safe for yaml.safe_dump and json."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple, set, frozenset)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return str(cfg) if isinstance(cfg, PurePath) else cfg


def _safe_load(stream: Any) -> Any:
    """One YAML document read safely (:mod:`raylane.config_yaml`); a refusal is a ConfigError."""
    try:
        return safe_load(stream)
    except YAMLRefused as exc:
        raise ConfigError(str(exc)) from None


def parse_override(text: str) -> tuple[str, Any]:
    """`"a.b=3"` -> `("a.b", 3)`; the value is parsed as YAML, an empty value is `""`."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {text!r}: expected the form key=value (e.g. workers=4 or sampler.fanouts=[10,5])")
    if not raw.strip():
        return key, ""
    try:
        return key, _safe_load(raw)
    except ConfigError as exc:
        raise ConfigError(f"bad override {text!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad override {text!r}: value is not valid YAML: {exc}") from exc


def merge(dst: dict[str, Any], src: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``src`` into ``dst`` (mappings key by key, anything else replaced by a copy); returns ``dst``."""
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def read_mapping(yaml_path: str | None) -> dict[str, Any]:
    """A YAML config file's top-level mapping ({} without a file, or for an empty one)."""
    if yaml_path is None:
        return {}
    try:
        with open(yaml_path, encoding="utf-8") as fh:
            loaded = _safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {yaml_path}") from exc
    except IsADirectoryError:
        raise ConfigError(f"config file {yaml_path}: is a folder; give a YAML file (e.g. {yaml_path}/config.yaml)") from None
    except PermissionError:
        raise ConfigError(f"config file {yaml_path}: this user may not read it; fix its permissions or copy it") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {yaml_path}: not UTF-8 text (it holds the byte {exc.object[exc.start:exc.start + 1]!r}); "
                          "give a YAML text file") from None
    except ConfigError as exc:
        raise ConfigError(f"{yaml_path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{yaml_path}: invalid YAML: {exc}") from exc
    except OSError as exc:  # e.g. a FIFO or device that fails to read
        raise ConfigError(f"config file {yaml_path}: cannot be read: {exc.strerror or exc}") from None
    if loaded is None:  # an empty file overrides nothing
        return {}
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{yaml_path}: the top level must be a mapping of keys to values, "
                          f"got {type(loaded).__name__}")
    return dict(loaded)


def load_config(cls: type[T], *, yaml_path: str | None = None, overrides: Sequence[str] = (),
                data: Mapping[str, Any] | None = None) -> T:
    """defaults <- data <- YAML file <- each `key=value` override, in order; then from_dict."""
    raw = merge(merge({}, data or {}), read_mapping(yaml_path))
    for text in overrides:
        key, value = parse_override(text)
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            if not isinstance(node.get(part), dict):  # a dotted key implies a mapping here
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return from_dict(cls, raw)


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """Flattened `(dotted key, type text, default, doc)` rows for CLI help; nested dataclasses
    are expanded. A required field's default is `MISSING`."""
    return _describe(cls, "", None)


def _describe(cls: type, prefix: str, base: Any) -> list[tuple[str, str, Any, str]]:
    docs, hints, rows = field_docs(cls), _hints(cls), []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = _join(prefix, f.name), hints.get(f.name, f.type)
        default = getattr(base, f.name) if base is not None else _default(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            rows += _describe(type(default), key, default)
        elif default is MISSING and isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows += _describe(tp, key, None)
        else:
            rows.append((key, _tname(tp), default, docs.get(f.name, "")))
    return rows
