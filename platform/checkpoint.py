"""Checkpoint store on ``pyarrow.fs`` (local folders, file://, s3://, gs://, ...).

Layout: ``<uri>/<step:010d>/{MANIFEST.json, state.json, tensors.pt, blob-<n>.bin}``, and a
``part-<name>/`` folder per part a stateful actor wrote itself (:mod:`raylane.checkpoint_parts`:
the driver never holds that state). Guarantees:

* Whole-or-ignored. A checkpoint exists only once its ``MANIFEST.json`` is in place; it is written
  last (locally to a temporary name renamed into place, on object stores as one PUT) and records
  the size and sha256 of every file, all checked before anything is deserialised. A save killed
  midway, a truncated upload or a flipped bit makes the step invisible to ``latest()`` (with a
  warning) and an error in ``load(step)``; a partial state is never returned.
  The manifest lists every part's files too, and is written only once every part is.
* No code execution on load: state is JSON, raw byte blobs and one tensor file read with
  ``torch.load(weights_only=True)``; pickle is never used (:mod:`raylane.checkpoint_format`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import warnings

import pyarrow.fs as pafs

from raylane.checkpoint_format import (FORMAT_VERSION, MANIFEST, READABLE_VERSIONS, STATE, CheckpointError, CheckpointInfo,
                                       StoredPart, decode, encode, file_entries)

log = logging.getLogger(__name__)
_PART_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def part_dir(root: str, step: int, name: str) -> str:
    """Where part ``name`` of checkpoint ``step`` lies under the store's ``root``."""
    if not _PART_NAME.fullmatch(name):
        raise ValueError(f"part name {name!r}: use 1-128 letters, digits, '_', '.' or '-'")
    return f"{root.rstrip('/')}/{step:010d}/part-{name}"

def _filesystem(uri: str) -> pafs.FileSystem:
    return pafs.FileSystem.from_uri(uri)[0] if "://" in uri else pafs.LocalFileSystem()


def write_part(uri: str, path: str, state: dict) -> dict[str, dict]:
    """Write ``state`` as a part's files into ``path`` on the filesystem of ``uri``;
    {file: {"size", "sha256"}} for the manifest."""
    files = encode(state)
    fs = _filesystem(uri)
    fs.create_dir(path, recursive=True)
    for name, payload in files.items():
        with fs.open_output_stream(f"{path}/{name}", compression=None) as f:
            f.write(payload)
    return file_entries(files)


def read_part(part: StoredPart) -> dict:
    """The state of a stored part, every file checked against the manifest first."""
    fs, data = _filesystem(part.uri), {}
    where = f"checkpoint step {part.step}, part {part.name!r} in {part.path}"
    for name, entry in part.files.items():
        try:
            with fs.open_input_stream(f"{part.path}/{name}", compression=None) as f:
                data[name] = f.read()
        except OSError as exc:
            raise CheckpointError(f"{where}: {name} cannot be read ({exc}); load an earlier step") from None
        if len(data[name]) != entry["size"] or hashlib.sha256(data[name]).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{where}: {name} does not match the manifest (size or sha256: torn or altered); "
                                  "it was not loaded - load an earlier step")
    return decode(data, where)



def _read_parts(obj):
    """``obj`` with every :class:`StoredPart` replaced by the state it holds."""
    if isinstance(obj, StoredPart):
        return read_part(obj)
    if isinstance(obj, dict):
        return {k: _read_parts(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_read_parts(v) for v in obj)
    return obj


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only folder); the message says
    where, how much, and what to change. The torn folder is removed."""


class CheckpointStore:
    def __init__(self, uri: str, keep: int = 3):
        """Open (and for local paths create) the store at ``uri``, keeping the newest ``keep``."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got keep={keep!r}")
        self.uri, self.keep = uri, keep
        self.fs, root = (pafs.FileSystem.from_uri(uri) if "://" in uri
                         else (pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))))
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        if self._local:  # object stores have no directories; creating a bucket may be forbidden
            self.fs.create_dir(self.root, recursive=True)
        # step -> manifest "created" of checkpoints this store wrote or fully hashed, so that
        # pruning after each save need not re-hash gigabytes (it still checks sizes).
        self._hashed: dict[int, float] = {}
        # step -> manifest "created" of checkpoints known to deserialise (written here or loaded)
        self._loadable: dict[int, float] = {}
        self._parts: dict[int, dict[str, StoredPart]] = {}  # step -> its parts, as its manifest lists them

    @property
    def local(self) -> bool:
        """A folder on this host's filesystem (parts are then written by actors on this host only)."""
        return self._local

    def _dir(self, step: int) -> str:
        return f"{self.root}/{step:010d}"

    def clear(self, step: int) -> None:
        """Remove any folder of ``step`` before its parts are written into it again (a run
        that went back and reaches the step anew): no old manifest may list new files."""
        self._require(step, exists=False)
        self._hashed.pop(step, None)
        self._loadable.pop(step, None)
        if self.fs.get_file_info(self._dir(step)).type != pafs.FileType.NotFound:
            self.fs.delete_dir(self._dir(step))

    def _scan(self) -> dict[int, bool]:
        """Step folders -> whether they hold a manifest."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root or "/", allow_not_found=True))
        steps = sorted(int(i.base_name) for i in infos if i.type == pafs.FileType.Directory
                       and len(i.base_name) == 10 and i.base_name.isascii() and i.base_name.isdigit())
        mans = self.fs.get_file_info([f"{self._dir(s)}/{MANIFEST}" for s in steps])
        return {s: m.type == pafs.FileType.File for s, m in zip(steps, mans)}

    def _write(self, path: str, data) -> None:
        with self.fs.open_output_stream(path, compression=None) as f:
            f.write(data)

    def _bad(self, step: int, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint step {step} in {self._dir(step)}: {what}; it is corrupted "
                               f"or incomplete - load an earlier step (steps: {self.steps()}) or delete it")

    def _check(self, step: int, full_hash: bool = True, want: bool = False):
        """Validate manifest and files; return (info, {name: bytes} if want)."""
        d = self._dir(step)
        try:
            with self.fs.open_input_stream(f"{d}/{MANIFEST}", compression=None) as f:
                m = json.loads(f.read())
            files, parts = m["files"], m.get("parts", {})
            ok = (m["version"] in READABLE_VERSIONS and m["step"] == step and isinstance(parts, dict)
                  and all(_PART_NAME.fullmatch(p) and isinstance(fs, dict) for p, fs in parts.items())
                  and all("/" not in n and "\\" not in n and type(e["size"]) is int and isinstance(e["sha256"], str)
                          for fs in parts.values() for n, e in fs.items())
                  and isinstance(m["created"], (int, float)) and STATE in files
                  and all("/" not in n and "\\" not in n and type(e["size"]) is int
                          and isinstance(e["sha256"], str) for n, e in files.items()))
            why = "" if ok else f"unexpected content: version {m.get('version')!r}, step {m.get('step')!r}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            raise self._bad(step, f"{MANIFEST} is unreadable ({why})")
        info = CheckpointInfo(step, d, float(m["created"]), {n: e["sha256"] for n, e in files.items()})
        full_hash = full_hash or self._hashed.get(step) != info.created
        data = {}
        listed = [(n, e, n) for n, e in files.items()]
        # Parts are checked by size here, hashed in full by verify() (streamed) and by the
        # actor that reads one back: the driver never holds an actor's state.
        listed += [(f"part-{p}/{n}", e, None) for p, fs in parts.items() for n, e in fs.items()]
        for (name, e, keep), fi in zip(listed, self.fs.get_file_info([f"{d}/{n}" for n, _, _ in listed])):
            if fi.type != pafs.FileType.File:
                raise self._bad(step, f"{name} is missing")
            if fi.size != e["size"]:
                raise self._bad(step, f"{name} has {fi.size} bytes, not {e['size']} (truncated?)")
            if not full_hash or (keep is None and want):
                continue
            with self.fs.open_input_stream(fi.path, compression=None) as f:
                # load() deserialises exactly the bytes it hashed; verify() streams to spare memory
                h = (hashlib.sha256(data.setdefault(name, f.read())) if want
                     else hashlib.file_digest(f, "sha256"))
            if h.hexdigest() != e["sha256"]:
                raise self._bad(step, f"{name} sha256 mismatch (manifest {e['sha256'][:12]}..., "
                                      f"file {h.hexdigest()[:12]}...)")
        self._hashed[step] = info.created
        self._parts[step] = {p: StoredPart(self.uri, f"{d}/part-{p}", step, p, dict(fs)) for p, fs in parts.items()}
        return info, data

    def _newest(self, load: bool):
        """Newest checkpoint that is whole and loads: (info, state if ``load``). Every
        checkpoint skipped on the way is warned about with its file and reason: a folder
        without a manifest (deleted, or a save that never finished), a corrupted file, or a
        tensor file that holds more than plain tensors. Returns (None, None, reasons) when
        none is left."""
        scan = self._scan()
        reasons: list[str] = []
        for step in sorted(scan, reverse=True):
            try:
                if not scan[step]:
                    raise self._bad(step, f"{MANIFEST} is missing (deleted, or a save that never finished)")
                # A checkpoint this store did not write is deserialised once before it is
                # called good: an intact file can still hold a refused pickle.
                info, data = self._check(step, want=load or step not in self._loadable)
                state = None
                if load or self._loadable.get(step) != info.created:
                    if not data:  # rewritten since it was last loaded: read it again
                        info, data = self._check(step, want=True)
                    state = self._deserialize(info, data)
                self._loadable[step] = info.created
                return info, state, reasons
            except CheckpointError as e:
                reasons.append(str(e))
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=3)
                log.warning("skipping checkpoint: %s", e)
        return None, None, reasons

    def _require(self, step, exists: bool = True) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**10:
            raise ValueError(f"step must be an int in [0, 10**10), got step={step!r}")
        if exists and step not in (steps := self.steps()):
            raise CheckpointError(f"no checkpoint for step {step} under {self.uri}; "
                                  f"existing steps: {steps}")

    def steps(self) -> list[int]:
        """Steps whose folder holds a manifest (valid or not), ascending."""
        return [s for s, has_manifest in self._scan().items() if has_manifest]

    def verify(self, step: int) -> CheckpointInfo:
        """Hash every file of ``step`` against its manifest; CheckpointError on any mismatch."""
        self._require(step)
        return self._check(step)[0]

    def latest(self) -> CheckpointInfo | None:
        """Newest valid checkpoint, skipping (with a warning) corrupted ones; None if none."""
        return self._newest(load=False)[0]

    def hint(self) -> str:
        """One sentence for an error message: where the last good checkpoint is, if any."""
        latest = self.latest()
        return f"The last good checkpoint is step {latest.step} at {latest.path}." if latest else "No checkpoint was written."

    def newest(self) -> tuple[CheckpointInfo | None, dict | None, list[str]]:
        """(info, state) of the newest checkpoint that is whole and loads, with why each
        newer one was skipped (also warned about); (None, None, reasons) when none loads.

        >>> info, state, skipped = store.newest()
        """
        return self._newest(load=True)

    def adopt(self, src: str, fs: pafs.FileSystem | None = None) -> int:
        """Make the checkpoint folder ``src`` (on ``fs``, default local) this store's only
        checkpoint and return its step: a trial restored by Ray Tune continues from the copy
        Tune hands back, which may come from another trial (population-based training).
        Only the manifest and the files it lists are copied; their hashes are checked when
        the checkpoint loads, as for any other."""
        fs = fs or pafs.LocalFileSystem()
        try:
            with fs.open_input_stream(f"{src}/{MANIFEST}", compression=None) as f:
                m = json.loads(f.read())
            step, names = m["step"], list(m["files"])
            names += [f"part-{p}/{n}" for p, fs in m.get("parts", {}).items() for n in fs]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{src}: no readable {MANIFEST} ({type(exc).__name__}: {exc}); not a raylane checkpoint") from None
        if type(step) is not int or step < 0 or any(".." in n or "\\" in n or n.count("/") > (n.startswith("part-")) for n in names):
            raise CheckpointError(f"{src}/{MANIFEST}: unexpected content (step {step!r}); not a raylane checkpoint")
        for old in self._scan():
            self.fs.delete_dir(self._dir(old))
        self._hashed.clear()
        self._loadable.clear()
        d = self._dir(step)
        self.fs.create_dir(d, recursive=True)
        for name in names + [MANIFEST]:
            if "/" in name:
                self.fs.create_dir(f"{d}/{name.rsplit('/', 1)[0]}", recursive=True)
            with fs.open_input_stream(f"{src}/{name}", compression=None) as f:
                self._write(f"{d}/{name}", f.read())
        return step

    def save(self, step: int, state: dict, parts: dict[str, dict] | None = None) -> CheckpointInfo:
        """Write ``state`` as checkpoint ``step`` (replacing any folder of that step), then prune.
        ``parts``: {name: {file: {"size", "sha256"}}} of the parts actors already wrote into
        the step's folder (:mod:`raylane.checkpoint_parts`); ``state`` names them with
        :class:`~raylane.checkpoint_format.PartRef`. The manifest, written last, lists them."""
        self._require(step, exists=False)
        blobs = encode(state)
        d = self._dir(step)
        self._hashed.pop(step, None)
        self._loadable.pop(step, None)
        files = file_entries(blobs)
        created = time.time()
        manifest = json.dumps({"version": FORMAT_VERSION, "step": step, "created": created,
                               "files": files, **({"parts": parts} if parts else {})}, indent=1).encode()
        try:
            if not parts and self.fs.get_file_info(d).type != pafs.FileType.NotFound:
                self.fs.delete_dir(d)  # (with parts, the folder already holds them)
            self.fs.create_dir(d, recursive=True)
            for name, payload in blobs.items():
                self._write(f"{d}/{name}", payload)
            if self._local:
                self._write(f"{d}/{MANIFEST}.tmp", manifest)
                self.fs.move(f"{d}/{MANIFEST}.tmp", f"{d}/{MANIFEST}")
            else:  # an object becomes visible whole when its upload completes
                self._write(f"{d}/{MANIFEST}", manifest)
        except OSError as exc:  # a full disk, a folder made read-only: say so, and leave no torn folder behind
            try:
                self.fs.delete_dir(d)
            except OSError:
                pass
            size = sum(f["size"] for f in files.values()) + len(manifest) + sum(e["size"] for fs in (parts or {}).values() for e in fs.values())
            raise CheckpointWriteError(f"checkpoint of step {step} ({size / 2**20:.1f} MiB) could not be written to {d}: {exc}. "
                                       "Free space there (or make it writable), or set driver.checkpoint_uri to another place; "
                                       "the checkpoints already written are whole") from exc
        self._hashed[step] = self._loadable[step] = created
        self._prune(step)
        return CheckpointInfo(step, d, created, {n: e["sha256"] for n, e in files.items()})

    def _prune(self, saved: int) -> None:
        kept = 0
        for step, has_manifest in sorted(self._scan().items(), reverse=True):
            # A torn save below `saved` can no longer complete; corrupted checkpoints among the
            # newest `keep` are left for inspection (latest() ignores them).
            if step == saved or (has_manifest and kept < self.keep and self._is_valid(step)):
                kept += 1
            elif (has_manifest and kept >= self.keep) or (not has_manifest and step < saved):
                self.fs.delete_dir(self._dir(step))
                self._hashed.pop(step, None)
                self._loadable.pop(step, None)

    def _is_valid(self, step: int) -> bool:
        try:
            return bool(self._check(step, full_hash=False))
        except CheckpointError:
            return False

    def load(self, step: int | None = None) -> tuple[int, dict]:
        """Return (step, state) of ``step`` or, if None, of the newest valid checkpoint."""
        if step is None:
            info, state, skipped = self._newest(load=True)
            if info is None:
                why = "".join(f"\n  skipped: {r}" for r in skipped)
                raise CheckpointError(f"no valid checkpoint under {self.uri} (steps with a manifest: "
                                      f"{self.steps()}); check the path or start from scratch{why}")
            return info.step, state
        self._require(step)
        info, data = self._check(step, want=True)
        return info.step, self._deserialize(info, data)

    def load_whole(self, step: int | None = None) -> tuple[int, dict]:
        """:meth:`load` with every part read into the state (each checked against the
        manifest): the whole checkpoint in this process, to inspect or export it. A run
        never does this; its actors read their own parts."""
        step, state = self.load(step)
        return step, _read_parts(state)

    def _deserialize(self, info: CheckpointInfo, data: dict[str, bytes]) -> dict:
        return decode(data, f"checkpoint step {info.step} in {info.path}", self._parts.get(info.step, {}))
