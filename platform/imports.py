"""Objects named by where they live: ``package.module:NAME`` or ``path/to/file.py:NAME``.

A job of your own, a policy network's factory, an env wrapper: each is written as an
import path. The module is imported here, in the driver, before Ray starts, so a path
that does not import is refused at once with the path tried and the error's first line.
A module that is not installed (your own file or package) is registered with Ray's
cloudpickle to travel by value, so what it defines reaches every actor without being
installed on the cluster's nodes; an installed module travels by name as usual.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any


class ImportPathError(ValueError):
    """An import path that does not name an object, with what was tried."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def split(target: str, what: str) -> tuple[str, str]:
    """``(where, NAME)`` of ``where:NAME``; refuses anything else naming ``what`` it is for."""
    where, _, attr = target.rpartition(":")
    if not where or not attr.isidentifier():
        raise ImportPathError(f"{what} {target!r}: write package.module:NAME or path/to/file.py:NAME")
    return where, attr


def load_module(where: str, target: str, what: str) -> ModuleType:
    """The module of ``where``: a file (imported as ``python path/to/file.py`` would, its
    folder first on ``sys.path``) or a dotted module (from ``sys.path``, the current
    folder included, as ``python -m`` would). Ships it by value if it is not installed."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where), target, what)
        ship(module)
        return module
    try:
        return import_module(where)
    except Exception as exc:  # noqa: BLE001 - any error importing the user's module is theirs to fix
        raise ImportPathError(f"{what} {target!r}: importing module {where!r} failed: {first_line(exc)}") from None


def cwd_on_path() -> None:
    """Put the current working folder first on ``sys.path`` unless it is there already (as
    ``""`` or by name). ``python -m raylane`` has it; the ``raylane`` console script has its
    own bin folder there instead, so ``examples.gridworld`` would not import from the
    project's folder. Ray puts the driver's working folder on every worker's path too
    (``ray.init``'s ``py_driver_sys_path``), so a worker imports what the driver imported."""
    cwd = str(Path.cwd())
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_module(name: str) -> ModuleType:
    """The user's dotted module ``name`` (an env module, a wrapper's, a factory's), imported
    as ``python -m`` would: from ``sys.path`` with the current folder on it
    (:func:`cwd_on_path`), then shipped by value if it is not installed (:func:`ship`).
    Raises what the import raises."""
    cwd_on_path()
    module = importlib.import_module(name)
    ship(module)
    return module


def load_object(target: str, what: str) -> Any:
    """The object ``NAME`` of ``where:NAME`` (see :func:`load_module`)."""
    where, attr = split(target, what)
    module = load_module(where, target, what)
    if not hasattr(module, attr):
        names = sorted(k for k in vars(module) if not k.startswith("_"))
        raise ImportPathError(f"{what} {target!r}: module {where!r} has no {attr!r}; it defines {', '.join(names[:12]) or 'nothing public'}")
    return getattr(module, attr)


def load_callable(target: str, what: str, shape: str) -> Any:
    """:func:`load_object`, refusing an object that cannot be called (``shape`` says what it
    should be, e.g. ``factory(spec) -> nn.Module``)."""
    obj = load_object(target, what)
    if not callable(obj):
        raise ImportPathError(f"{what} {target!r} is a {type(obj).__name__}, not a callable {shape}")
    return obj


def installed(module: ModuleType) -> bool:
    """True for raylane, the standard library and installed packages: they are on every node."""
    if module.__name__ == "raylane" or module.__name__.startswith("raylane."):
        return True
    path = getattr(module, "__file__", None)
    if path is None:
        return True  # built in, or a namespace package: nothing to ship
    resolved = Path(path).resolve()
    paths = sysconfig.get_paths()
    return any(resolved.is_relative_to(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib"))


def ship(module: ModuleType) -> None:
    """Let what ``module`` defines travel to the actors by value, unless it is installed."""
    if installed(module):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _import_file(path: Path, target: str, what: str) -> ModuleType:
    if not path.is_file():
        raise ImportPathError(f"{what} {target!r}: no file {str(path)!r} (from {str(Path.cwd())!r})")
    path = path.resolve()
    # A private module name per file, so two user files called job.py do not collide.
    name = f"raylane_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # its sibling modules import as they would under `python file.py`
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise ImportPathError(f"{what} {target!r}: {str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error running the user's file is theirs to fix
        del sys.modules[name]
        raise ImportPathError(f"{what} {target!r}: importing {str(path)!r} failed: {first_line(exc)}") from None
    return module
