"""The best checkpoint of a run, kept apart from the rotation (``driver.keep_best``).

Layout: ``<checkpoint store>/best/<step:010d>/`` (a checkpoint folder as any other, with its
``MANIFEST.json``) and ``<checkpoint store>/best/BEST.json`` naming its step, metric, mode and
value. The main store lists only step folders, so it never prunes ``best/``; a later run
step that overwrites its own folder leaves the kept copy alone.

The copy is taken from a committed checkpoint: on a local filesystem as hard links (no
bytes copied: the store never rewrites a file in place, every save starts from an empty
folder), elsewhere with the filesystem's own copy (a server-side copy on object stores).
The manifest is copied last and ``BEST.json`` written after it, so a kill midway leaves the
previous best whole and named; older copies are removed only then. (A replay that reaches the
kept step again with a better value rewrites that step's copy in place: a kill then leaves
no kept best, which the next improvement makes again.)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pyarrow.fs as pafs

from raylane.checkpoint import CheckpointStore
from raylane.checkpoint_format import MANIFEST

RECORD = "BEST.json"


def beside(uri: str, name: str) -> str:
    """The URI of folder ``name`` inside the store at ``uri`` (a query such as s3's
    ``endpoint_override`` stays at the end).

    >>> beside("s3://b/runs/r?endpoint_override=localhost:9000", "best")
    's3://b/runs/r/best?endpoint_override=localhost:9000'
    """
    base, sep, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


class BestStore:
    """The kept best checkpoint of the run whose checkpoints ``main`` holds."""

    def __init__(self, main: CheckpointStore):
        self.main = main
        self.store = CheckpointStore(beside(main.uri, "best"), keep=1)

    @property
    def path(self) -> str:
        return self.store.root

    def record(self) -> dict[str, Any] | None:
        """What ``BEST.json`` says (metric, mode, value, step, path), or None when nothing is kept
        or the file does not name a whole checkpoint."""
        try:
            with self.store.fs.open_input_stream(f"{self.store.root}/{RECORD}", compression=None) as f:
                rec = json.loads(f.read())
        except (OSError, ValueError, KeyError, TypeError):
            return None
        # Sizes against the manifest (hashes are checked when it is loaded or exported): a
        # start of the run does not read a kept checkpoint of gigabytes back from its store.
        return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) and self.store._is_valid(rec["step"]) else None

    def keep(self, step: int, best: dict[str, Any], current: dict[str, Any] | None = None) -> dict[str, Any]:
        """Copy the main store's checkpoint ``step`` here as the best, with ``best`` (metric,
        mode, value) recorded; the previous best goes once the new one is whole. Returns the
        record. ``current``: the record kept now (nothing is copied when it is this step and value)."""
        if current is not None and current.get("step") == step and {k: current.get(k) for k in best} == best:
            return current  # a replay that reached the same step with the same value: the copy kept is this one
        src, dst = self.main._dir(step), self.store._dir(step)
        with self.main.fs.open_input_stream(f"{src}/{MANIFEST}", compression=None) as f:
            manifest = json.loads(f.read())
        names = list(manifest["files"]) + [f"part-{p}/{n}" for p, fs in manifest.get("parts", {}).items() for n in fs]
        if self.store.fs.get_file_info(dst).type != pafs.FileType.NotFound:
            self.store.fs.delete_dir(dst)
        for name in names + [MANIFEST]:
            self._copy(f"{src}/{name}", f"{dst}/{name}")
        rec = {**best, "step": step, "path": dst, "created": time.time()}
        self._write_record(rec)
        for old in self.store._scan():
            if old != step:
                self.store.fs.delete_dir(self.store._dir(old))
        return rec

    def _copy(self, src: str, dst: str) -> None:
        self.store.fs.create_dir(dst.rsplit("/", 1)[0], recursive=True)
        if self.main.local:
            try:
                os.link(src, dst)
                return
            except OSError:  # a filesystem without hard links: copy the bytes
                pass
        self.main.fs.copy_file(src, dst)

    def _write_record(self, rec: dict[str, Any]) -> None:
        data, path = json.dumps(rec, indent=1).encode(), f"{self.store.root}/{RECORD}"
        if self.main.local:
            self.store._write(f"{path}.tmp", data)
            self.store.fs.move(f"{path}.tmp", path)
        else:  # an object becomes visible whole when its upload completes
            self.store._write(path, data)
