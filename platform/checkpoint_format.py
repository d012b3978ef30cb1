"""How a state dict becomes checkpoint files and back, without pickle: JSON for the
structure, one ``torch.save`` file of plain tensors (read with ``weights_only=True``), raw
byte blobs. Used by the driver's :class:`raylane.checkpoint.CheckpointStore` and by every
actor that writes its own part (:mod:`raylane.checkpoint_parts`)."""
from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass

import numpy as np
import torch

FORMAT_VERSION = 2  # 2: a manifest may list parts written by actors
READABLE_VERSIONS = (1, 2)
MANIFEST, STATE, TENSORS = "MANIFEST.json", "state.json", "tensors.pt"
_TENSOR, _NDARRAY, _BYTES = "__tensor__", "__ndarray__", "__bytes__"
_ITEMS, _TUPLE = "__items__", "__tuple__"  # a dict with int keys, a tuple (an optimizer's state_dict has both)
_PART = "__part__"  # a part an actor wrote beside the driver's state (raylane.checkpoint_parts)
_RESERVED = (_TENSOR, _NDARRAY, _BYTES, _ITEMS, _TUPLE, _PART)
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


@dataclass(frozen=True)
class PartRef:
    """In a state being saved: the part ``name`` an actor wrote itself (the manifest lists its files)."""

    name: str


@dataclass(frozen=True)
class StoredPart:
    """In a loaded state: a part an actor wrote, for that actor (or its replacement) to read
    back with :func:`raylane.checkpoint_parts.read_part` (sizes and sha256 checked first)."""

    uri: str
    """The store's URI (a local folder or a pyarrow filesystem URI)."""
    path: str
    """The part's folder within the store's filesystem."""
    step: int
    name: str
    files: dict
    """file name -> {"size": bytes, "sha256": hex digest}, from the manifest."""


def _encode(obj, path: tuple, tensors: dict, blobs: dict):
    """Replace tensors, arrays and bytes by placeholders; reject anything JSON would mangle."""
    if isinstance(obj, PartRef):
        return {_PART: obj.name}
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


def _decode(obj, tensors: dict, blobs: dict, parts: dict | None = None):
    if isinstance(obj, list):
        return [_decode(v, tensors, blobs, parts) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _PART in obj:
        if parts is None or obj[_PART] not in parts:
            raise KeyError(f"part {obj[_PART]!r} is not in the manifest")
        return parts[obj[_PART]]
    # save() rejects the reserved names as user keys, so any dict holding one is a placeholder.
    for kind, table in ((_TENSOR, tensors), (_NDARRAY, tensors), (_BYTES, blobs)):
        if kind in obj:
            return table[obj[kind]].numpy() if kind == _NDARRAY else table[obj[kind]]
    if _ITEMS in obj:
        return {k: _decode(v, tensors, blobs, parts) for k, v in obj[_ITEMS]}
    if _TUPLE in obj:
        return tuple(_decode(v, tensors, blobs, parts) for v in obj[_TUPLE])
    return {k: _decode(v, tensors, blobs, parts) for k, v in obj.items()}


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




def encode(state: dict) -> dict[str, bytes]:
    """``state`` as the files of a checkpoint (or of a part): ``state.json``, ``tensors.pt``
    when it holds tensors or arrays, ``blob-<n>.bin`` per bytes value."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
    tensors, blobs = {}, {}
    state_json = json.dumps(_encode(state, (), tensors, blobs), allow_nan=True).encode()
    if tensors:
        torch.save(tensors, buf := io.BytesIO())
        blobs = {TENSORS: buf.getbuffer(), **blobs}
    return {**blobs, STATE: state_json}


def file_entries(files: dict[str, bytes]) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of encoded files, as a manifest lists them."""
    return {name: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()} for name, payload in files.items()}


def decode(data: dict[str, bytes], where: str, parts: dict | None = None) -> dict:
    """The state of files :func:`encode` wrote (already checked against their manifest);
    ``where`` names them in errors, ``parts`` maps part names to :class:`StoredPart`."""
    tensors = {}
    if TENSORS in data:
        try:
            tensors = torch.load(io.BytesIO(data[TENSORS]), weights_only=True, map_location="cpu")
            ok = isinstance(tensors, dict) and all(type(v) is torch.Tensor for v in tensors.values())
            why = "" if ok else "it does not hold a dict of tensors"
        except Exception as e:  # weights_only unpickler refuses anything but plain tensors
            why = _refusal(e)
        if why:
            raise CheckpointError(f"{where}: {TENSORS} is not a plain-tensor file ({why}); it was not written by raylane "
                                  "and was not loaded - delete it or load another step")
    try:
        return _decode(json.loads(data[STATE]), tensors, {n: b for n, b in data.items() if n.startswith("blob-")}, parts)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: {STATE} is inconsistent ({type(e).__name__}: {e}); load another step") from None
