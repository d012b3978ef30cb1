"""Checkpoint parts: a stateful actor writes its own state into the checkpoint, so the
driver never holds it (its memory does not grow with the model) and the writes of many
actors run in parallel, while the next steps run.

The protocol, in three moves:

1. **Snapshot** (the step's only stall). At the step boundary the workload's ``state_dict``
   calls :func:`snapshot` on its stateful actors: each copies its state in memory and
   answers with a token. The workload returns the :class:`Part` objects in its state.
2. **Persist** (in the background). The driver's checkpointer asks each actor to write its
   snapshot into the step's folder (``persist_part`` starts a thread) and goes on stepping;
   ``part_written`` (in the actor's ``checkpoint`` concurrency group, so its other calls go
   on) answers with the files' sizes and sha256 once they are written.
3. **Commit.** Once every part is written, the driver writes its own small state and the
   manifest, last: a checkpoint is whole or absent. A kill before that leaves the previous
   checkpoint the newest valid one.

On load an actor (or its replacement) gets a :class:`~raylane.checkpoint_format.StoredPart`
and reads it itself (``load_part``), after checking every file's size and sha256 against
the manifest: a torn or altered part is never loaded.

An actor class takes part by inheriting :class:`CheckpointParts`, defining
``export_state()`` (a copy of its state: arrays, tensors, plain data) and
``import_state(state)``, and declaring ``concurrency_groups=CHECKPOINT_GROUPS`` (merged with
any of its own) in its ``ray.remote``. The ``checkpoint`` group's two threads answer the
wait for a write (``part_written``) and the reads of a snapshot (``peek_snapshot``, by a
keeper or a restore) while the actor's own calls run: a keeper's copy must not queue
behind a step that takes the actor's main thread (a learner's update, a pipeline stage's
batch), or a node lost in that step takes the copy with it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import ray
import torch

from raylane.checkpoint import read_part, write_part  # noqa: F401 - the actors' side reads and writes through these
from raylane.checkpoint_format import CheckpointError, StoredPart

CHECKPOINT_GROUP = "checkpoint"
CHECKPOINT_GROUPS = {CHECKPOINT_GROUP: 2}
"""The concurrency groups a :class:`CheckpointParts` actor declares (merge in its own)."""


@dataclass
class Part:
    """In a workload's state: one actor's snapshot, still in that actor's memory."""

    handle: Any
    """The actor holding the snapshot."""
    token: int
    """Which snapshot (an actor keeps one per checkpoint in flight)."""
    nbytes: int
    """The snapshot's size in memory (arrays and tensors)."""
    node_ip: str
    """The address of the actor's node: a local checkpoint folder is written by actors on the driver's host only."""
    node_id: str = ""
    """The actor's node (its replica goes to another one)."""


def snapshot(handles: Mapping[str, Any], timeout_s: float) -> dict[str, Part]:
    """Snapshot every actor of ``handles`` (key -> actor handle of a :class:`CheckpointParts`
    class) at once; {key: Part}. Raises what a lost actor raises, or ``GetTimeoutError``."""
    refs = {k: h.snapshot_part.remote() for k, h in handles.items()}
    got = ray.get(list(refs.values()), timeout=timeout_s)
    return {k: Part(handles[k], **g) for k, g in zip(refs, got)}


def state_bytes(obj: Any) -> int:
    """Bytes of the arrays and tensors in ``obj`` (what a snapshot costs in memory)."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, bytes):
        return len(obj)
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


class CheckpointParts:
    """Actor mixin: the actor's side of the protocol (see the module docstring).

    An actor keeps its newest snapshot (a survivor of a lost peer restores from it without
    a transfer, and a keeper copies it) and any snapshot still being written; older ones go."""

    def export_state(self) -> dict:  # pragma: no cover - the actor class defines it
        raise NotImplementedError

    def import_state(self, state: Mapping[str, Any]) -> None:  # pragma: no cover - the actor class defines it
        raise NotImplementedError

    def _parts(self) -> _Snapshots:
        if not hasattr(self, "_part_snapshots"):
            self._part_snapshots = _Snapshots()
        return self._part_snapshots

    def snapshot_part(self) -> dict:
        """Copy the state now (``export_state`` copies); {token, nbytes, node_ip, node_id}."""
        state = self.export_state()
        token = self._parts().add(state)
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        return {"token": token, "nbytes": state_bytes(state), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ctx.get_node_id() if ctx is not None else ""}

    def persist_part(self, uri: str, path: str, token: int) -> None:
        """Start writing snapshot ``token`` into ``path`` in a thread of its own; the call
        returns at once (it runs in order after the snapshot, so the snapshot is still
        here), and :meth:`part_written` answers when the files are written."""
        snaps = self._parts()
        done = snaps.writing(token)
        try:
            state = snaps.get(token)
        except CheckpointError as exc:
            done.set_exception(exc)
            snaps.written(token)
            raise
        threading.Thread(target=_write_into, args=(done, uri, path, state, lambda: snaps.written(token)), daemon=True,
                         name=f"persist-part-{token}").start()

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def part_written(self, token: int, timeout_s: float) -> dict[str, dict]:
        """The files of snapshot ``token`` once written (sizes and sha256), or the write's error."""
        snaps = self._parts()
        try:
            return snaps.writing(token).result(timeout=timeout_s)
        finally:
            snaps.answered(token)

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def has_snapshot(self, token: int) -> bool:
        return self._parts().has(token)

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def peek_snapshot(self, token: int) -> dict:
        """Snapshot ``token`` itself: for its keeper, for a driver that stores it (a local
        folder the actor's host cannot reach), or to restore from."""
        return self._parts().get(token)

    take_snapshot = peek_snapshot

    def load_part(self, part: StoredPart | Mapping[str, Any]) -> None:
        """Restore from a stored part (read and checked here), or from a state given whole
        (a replica from memory, or a checkpoint written before parts)."""
        self.import_state(read_part(part) if isinstance(part, StoredPart) else part)


class _Snapshots:
    """An actor's snapshots by token: the newest, and those being written."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.snaps: dict[int, dict] = {}
        self.futures: dict[int, Future] = {}
        self.newest = 0

    def add(self, state: dict) -> int:
        with self.lock:
            self.newest += 1
            self.snaps[self.newest] = state
            for t in [t for t in self.snaps if t != self.newest and not (t in self.futures and not self.futures[t].done())]:
                del self.snaps[t]
            return self.newest

    def has(self, token: int) -> bool:
        with self.lock:
            return token in self.snaps

    def get(self, token: int) -> dict:
        with self.lock:
            if token not in self.snaps:
                raise CheckpointError(f"snapshot {token} is not held here (a newer one replaced it, or this actor was restarted)")
            return self.snaps[token]

    def writing(self, token: int) -> Future:
        """The write of ``token``, made by whichever comes first: the write or the wait for it."""
        with self.lock:
            return self.futures.setdefault(token, Future())

    def written(self, token: int) -> None:
        """The write of ``token`` ended: its snapshot goes unless it is the newest (its
        future stays for :meth:`answered`, whichever call comes first)."""
        with self.lock:
            if token != self.newest:
                self.snaps.pop(token, None)

    def answered(self, token: int) -> None:
        """``part_written`` has given the write's outcome: nothing of it is kept any longer."""
        with self.lock:
            fut = self.futures.get(token)
            if fut is not None and fut.done():
                del self.futures[token]


def _write_into(done: Future, uri: str, path: str, state: dict, after: Any) -> None:
    try:
        done.set_result(write_part(uri, path, state))
    except BaseException as exc:  # noqa: BLE001 - handed to part_written's caller
        done.set_exception(exc)
    finally:
        after()
