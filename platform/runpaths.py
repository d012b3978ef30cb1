"""Where a run writes, checked before anything starts: its name and its folders.

A run name becomes a folder under ``runs_dir`` and under the checkpoint root, so a name
holding a path separator or ``..`` would write outside them; a folder that cannot be
written would otherwise fail only after Ray and the actors are up, deep in a traceback.
"""

from __future__ import annotations

import os
import tempfile
import unicodedata
from pathlib import Path

MAX_RUN_NAME = 128


class RunPathError(ValueError):
    """A run name or folder that cannot be used; the message says what would do."""


def check_run_name(name: str, where: str = "run name") -> str:
    """``name`` if it is a usable run name, else :class:`RunPathError` naming the problem.

    >>> check_run_name("ppo-cartpole-2")
    'ppo-cartpole-2'
    """
    rule = (f"a run name is one folder name: 1 to {MAX_RUN_NAME} characters, no '/' or '\\', "
            "not '.' or '..', no control characters (e.g. ppo-lr3e-4)")
    if not isinstance(name, str) or not name.strip():
        raise RunPathError(f"{where} {name!r} is empty; {rule}")
    if len(name) > MAX_RUN_NAME:
        raise RunPathError(f"{where} has {len(name)} characters; {rule}")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise RunPathError(f"{where} {name!r} would write outside the runs folder; {rule}")
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise RunPathError(f"{where} {name!r} holds a control character; {rule}")
    if name != name.strip():
        raise RunPathError(f"{where} {name!r} starts or ends with a space; {rule}")
    return name


def check_writable_dir(path: str, what: str) -> None:
    """Create ``path`` (a local folder, or a ``file://`` URI) and write a file in it, or
    raise :class:`RunPathError` naming ``what`` and the reason. Other URIs (``s3://``,
    ``gs://``) are left to their filesystem: creating a bucket may be forbidden and a
    probe object costs a request."""
    if "://" in path and not path.startswith("file://"):
        return
    local = Path(os.path.expanduser(path.removeprefix("file://")))
    try:
        local.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=local, prefix=".raylane-probe-"):
            pass
    except OSError as exc:
        raise RunPathError(f"{what}={path!r} cannot be used: {exc.strerror or exc} "
                           f"({type(exc).__name__}); choose a folder this user can create and write") from None
