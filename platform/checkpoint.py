"""Checkpoint store on ``pyarrow.fs`` (local folders, file://, s3://, gs://, ...).

Layout: ``<uri>/<step:010d>/{MANIFEST.json, state.json, tensors.pt, blob-<n>.bin}``. Guarantees:

* Whole-or-ignored. A checkpoint exists only once its ``MANIFEST.json`` is in place; it is written
  last (locally to a temporary name renamed into place, on object stores as one PUT) and records
  the size and sha256 of every file, all checked before anything is deserialised. A save killed
  midway, a truncated upload or a flipped bit makes the step invisible to ``latest()`` (with a
  warning) and an error in ``load(step)``; a partial state is never returned.
* No code execution on load: state is JSON, raw byte blobs and one tensor file read with
  ``torch.load(weights_only=True)``; pickle is never used.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST, STATE, TENSORS = "MANIFEST.json", "state.json", "tensors.pt"
_TENSOR, _NDARRAY, _BYTES = "__tensor__", "__ndarray__", "__bytes__"
_ITEMS, _TUPLE = "__items__", "__tuple__"  # a dict with int keys, a tuple (an optimizer's state_dict has both)
_RESERVED = (_TENSOR, _NDARRAY, _BYTES, _ITEMS, _TUPLE)
_ALLOWED = ("torch.Tensor (dense), numpy.ndarray (numeric dtype), bytes, None, bool, int, "
            "float, str, and lists, tuples and dicts (str or int keys) of those")


class CheckpointError(Exception):
    """A checkpoint is missing, corrupted, or the state cannot be stored as asked."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    created: float
    files: dict[str, str]


def _where(path: tuple) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _encode(obj, path: tuple, tensors: dict, blobs: dict):
    """Replace tensors, arrays and bytes by placeholders; reject anything JSON would mangle."""
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{_where(path)} has key {k!r} of type {type(k).__name__}; "
                                "checkpoint dict keys must be str or int")
            if k in _RESERVED:
                raise CheckpointError(f"{_where(path + (k,))}: key {k!r} is reserved by the "
                                      "checkpoint format; rename it")
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, path + (k,), tensors, blobs) for k, v in obj.items()}
        return {_ITEMS: [[k, _encode(v, path + (k,), tensors, blobs)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [_encode(v, path + (i,), tensors, blobs) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, path + (i,), tensors, blobs) for i, v in enumerate(obj)]}
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        kind, t = (_NDARRAY, None) if isinstance(obj, np.ndarray) else (_TENSOR, obj)
        if kind == _NDARRAY and obj.dtype.kind in "biufc":
            try:
                # native byte order; C order (not ascontiguousarray, which makes 0-d arrays 1-d)
                # (a read-only array, e.g. one fetched from Ray's object store, is copied:
                # torch refuses to wrap memory it may not write)
                t = torch.from_numpy(obj.astype(obj.dtype.newbyteorder("="), order="C", copy=not obj.flags.writeable))
            except TypeError:  # a numeric dtype torch lacks, e.g. longdouble
                pass
        if t is None or t.layout != torch.strided:
            raise TypeError(f"{_where(path)}: unsupported {type(obj).__name__} (dtype {obj.dtype}, "
                            f"layout {getattr(obj, 'layout', 'strided')}); allowed leaves: {_ALLOWED}")
        t = t.detach().cpu().resolve_conj().resolve_neg()
        # torch.save writes whole storages: a small view of a big tensor would store all of it.
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        tensors[key := json.dumps(path)] = t
        return {kind: key}
    if isinstance(obj, bytes):
        blobs[name := f"blob-{len(blobs)}.bin"] = obj
        return {_BYTES: name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{_where(path)}: unsupported value of type {type(obj).__qualname__}; "
                    f"allowed leaves: {_ALLOWED}")


def _decode(obj, tensors: dict, blobs: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors, blobs) for v in obj]
    if not isinstance(obj, dict):
        return obj
    # save() rejects the reserved names as user keys, so any dict holding one is a placeholder.
    for kind, table in ((_TENSOR, tensors), (_NDARRAY, tensors), (_BYTES, blobs)):
        if kind in obj:
            return table[obj[kind]].numpy() if kind == _NDARRAY else table[obj[kind]]
    if _ITEMS in obj:
        return {k: _decode(v, tensors, blobs) for k, v in obj[_ITEMS]}
    if _TUPLE in obj:
        return tuple(_decode(v, tensors, blobs) for v in obj[_TUPLE])
    return {k: _decode(v, tensors, blobs) for k, v in obj.items()}


def _refusal(exc: Exception) -> str:
    """Why torch's weights-only loader refused a file, without its advice to retry with
    ``weights_only=False`` (which would run the code it refused)."""
    text = str(exc)
    if m := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL)\s+([\w.]+)", text):
        return f"it imports {m.group(1)}, which a tensor file never needs"
    if m := re.search(r"WeightsUnpickler error:\s*([^\n]+)", text):
        return m.group(1).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln]
    return lines[0] if lines else type(exc).__name__


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

    def _dir(self, step: int) -> str:
        return f"{self.root}/{step:010d}"

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
            files = m["files"]
            ok = (m["version"] == FORMAT_VERSION and m["step"] == step
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
        for (name, e), fi in zip(files.items(), self.fs.get_file_info([f"{d}/{n}" for n in files])):
            if fi.type != pafs.FileType.File:
                raise self._bad(step, f"{name} is missing")
            if fi.size != e["size"]:
                raise self._bad(step, f"{name} has {fi.size} bytes, not {e['size']} (truncated?)")
            if not full_hash:
                continue
            with self.fs.open_input_stream(fi.path, compression=None) as f:
                # load() deserialises exactly the bytes it hashed; verify() streams to spare memory
                h = (hashlib.sha256(data.setdefault(name, f.read())) if want
                     else hashlib.file_digest(f, "sha256"))
            if h.hexdigest() != e["sha256"]:
                raise self._bad(step, f"{name} sha256 mismatch (manifest {e['sha256'][:12]}..., "
                                      f"file {h.hexdigest()[:12]}...)")
        self._hashed[step] = info.created
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
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{src}: no readable {MANIFEST} ({type(exc).__name__}: {exc}); not a raylane checkpoint") from None
        if type(step) is not int or step < 0 or any("/" in n or "\\" in n for n in names):
            raise CheckpointError(f"{src}/{MANIFEST}: unexpected content (step {step!r}); not a raylane checkpoint")
        for old in self._scan():
            self.fs.delete_dir(self._dir(old))
        self._hashed.clear()
        self._loadable.clear()
        d = self._dir(step)
        self.fs.create_dir(d, recursive=True)
        for name in names + [MANIFEST]:
            with fs.open_input_stream(f"{src}/{name}", compression=None) as f:
                self._write(f"{d}/{name}", f.read())
        return step

    def save(self, step: int, state: dict) -> CheckpointInfo:
        """Write ``state`` as checkpoint ``step`` (replacing any folder of that step), then prune."""
        self._require(step, exists=False)
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
        tensors, blobs = {}, {}
        state_json = json.dumps(_encode(state, (), tensors, blobs), allow_nan=True).encode()
        d = self._dir(step)
        self._hashed.pop(step, None)
        self._loadable.pop(step, None)
        if tensors:
            torch.save(tensors, buf := io.BytesIO())
            blobs = {TENSORS: buf.getbuffer(), **blobs}
        files = {name: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
                 for name, payload in {**blobs, STATE: state_json}.items()}
        created = time.time()
        manifest = json.dumps({"version": FORMAT_VERSION, "step": step, "created": created,
                               "files": files}, indent=1).encode()
        try:
            if self.fs.get_file_info(d).type != pafs.FileType.NotFound:
                self.fs.delete_dir(d)
            self.fs.create_dir(d, recursive=True)
            for name, payload in {**blobs, STATE: state_json}.items():
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
            size = sum(f["size"] for f in files.values()) + len(manifest)
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

    def _deserialize(self, info: CheckpointInfo, data: dict[str, bytes]) -> dict:
        tensors = {}
        if TENSORS in data:
            try:
                tensors = torch.load(io.BytesIO(data[TENSORS]), weights_only=True, map_location="cpu")
                ok = isinstance(tensors, dict) and all(type(v) is torch.Tensor for v in tensors.values())
                why = "" if ok else "it does not hold a dict of tensors"
            except Exception as e:  # weights_only unpickler refuses anything but plain tensors
                why = _refusal(e)
            if why:
                raise CheckpointError(
                    f"checkpoint step {info.step}: {TENSORS} in {info.path} is not a plain-tensor file "
                    f"({why}); it was not written by CheckpointStore and was not loaded - delete it "
                    "or load another step")
        try:
            return _decode(json.loads(data[STATE]), tensors,
                           {n: b for n, b in data.items() if n.startswith("blob-")})
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint step {info.step}: {STATE} in {info.path} is inconsistent "
                                  f"({type(e).__name__}: {e}); load another step") from None
