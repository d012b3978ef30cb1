"""Gloo links between the stages of one pipeline: where the group meets, what listens, and
how long one wait may take.

Where it lives: inside each :class:`~raylane.actors.pipeline_stage.LinkedStage` of a
pipeline that uses the ``gloo`` transport; stage 0 picks the rendezvous
(:func:`rendezvous`) and every stage joins with it (:class:`GlooLink`).

What listens: with every stage of the pipeline on one node, the group meets in a file
(torch's ``FileStore``, in the node's temp folder: no socket) and each stage's gloo device
binds 127.0.0.1, so nothing the group opens is reachable from the network. Across nodes,
stage 0 hosts a ``TCPStore`` on a free port (torch's store server binds every interface)
and each stage's gloo device binds its node's address; keep those nodes on a private
network (deploy/README.md).

What a failure means: the group's setup is bounded by the connect timeout and every later
wait on a peer (a receive, a send's completion) by the link timeout; a peer that died or
stopped sending ends it with :class:`LinkError`, naming the peer, the message and the time
waited, instead of a hang.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import ray
import torch

LOOPBACK = "127.0.0.1"

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


@dataclass(frozen=True)
class Rendezvous:
    """Where one pipeline's gloo group meets (chosen on stage 0, copied to every stage)."""

    host: str
    """Address the stages' gloo devices bind: 127.0.0.1 on one node; across nodes stage 0's
    node address (its store's too), and every other stage binds its own node's address."""
    port: int = 0
    """The TCPStore's port on ``host`` (across nodes); 0 with a file store."""
    path: str = ""
    """The FileStore's file (one node); empty across nodes."""

    @property
    def local(self) -> bool:
        return bool(self.path)


def rendezvous(local: bool) -> Rendezvous:
    """A fresh meeting place for a group hosted by this process: a file in this node's temp
    folder when ``local`` (every stage on this node), else a free port on this node's address."""
    if local:
        return Rendezvous(LOOPBACK, path=os.path.join(tempfile.gettempdir(), f"raylane-gloo-{uuid.uuid4().hex}"))
    host, port = _free_port()
    return Rendezvous(host, port=port)


class LinkError(RuntimeError):
    """A gloo wait ended without its message: the peer died, left, or sent nothing in time."""


def _wait(work: Any, rank: int, what: str, wait_s: float) -> None:
    t0 = time.monotonic()
    try:
        work.wait(timedelta(seconds=wait_s))
    except RuntimeError as exc:
        raise _link_error(exc, rank, what, time.monotonic() - t0, wait_s) from exc


def _link_error(exc: BaseException, rank: int, what: str, waited_s: float, wait_s: float) -> LinkError:
    text = str(exc).strip()
    if "timed out" in text.lower():
        why = f"nothing came within the link timeout of {wait_s:g} s (a peer stuck, or gone without closing its connection)"
    elif "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
        why = "the peer closed its connection (it died, or left the group after an error)"
    else:
        why = text.splitlines()[0][:300] if text else type(exc).__name__
    return LinkError(f"stage {rank}: gloo {what} failed after {waited_s:.1f} s: {why}")


class GlooLink:
    """Point-to-point tensors between the stages of one pipeline over a gloo process group
    of their own (not the process's default group, so a stage can leave one and join the
    next after a re-split). ``setup_s`` bounds the group's forming, ``wait_s`` every wait
    on a peer after that (a receive, a send's completion).

    The first batch after joining sends a small header (dtype, shape) before each tensor,
    and both sides remember the shape per message; later batches send the tensor alone,
    into receives posted ahead (:meth:`begin`, a few messages ahead of use). A receive
    posted late costs a round trip to a sender that is busy computing, which on a machine
    with as many busy stages as cores came to several milliseconds a hop; posted ahead,
    the data lands while the receiver is still computing. Sends are non-blocking;
    :meth:`flush` waits for them at the end of a batch."""

    MAX_DIMS = 6
    WINDOW = 4  # receives posted ahead of use

    def __init__(self, where: Rendezvous, rank: int, size: int, setup_s: float, wait_s: float):
        from torch.distributed import FileStore, ProcessGroupGloo, TCPStore

        self.rank, self.size, self.wait_s = rank, size, wait_s
        limit = timedelta(seconds=setup_s)
        if where.local:
            self.store = FileStore(where.path, size)
            self.store.set_timeout(limit)
        else:
            self.store = TCPStore(where.host, where.port, size, rank == 0, timeout=limit)
        opts = ProcessGroupGloo._Options()
        opts._timeout = limit
        host = where.host if where.local or rank == 0 else _node_ip()
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.pg = ProcessGroupGloo(self.store, rank, size, opts)
        except RuntimeError as exc:
            raise LinkError(f"stage {rank}: the gloo group of {size} stages did not form within {setup_s:g} s at {where}: {str(exc).strip()[:300]}") from exc
        self.pending: list[tuple[Any, ...]] = []
        self.shapes: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}  # tag -> what the first batch carried
        self.warm = False  # a batch has completed: shapes are known on both sides
        self.expected: list[tuple[int, int]] = []  # (src, tag) still to post, in the order they are used
        self.posted: dict[int, tuple[torch.Tensor, Any, int]] = {}  # tag -> (buffer, work, source stage)

    def begin(self, expected: Sequence[tuple[int, int]]) -> None:
        """A batch starts: ``expected`` are its incoming (source stage, tag), in the order
        they will be taken."""
        self.expected, self.posted = (list(expected) if self.warm else []), {}
        self._post()

    def _post(self) -> None:
        if not self.warm:
            return
        while self.expected and len(self.posted) < self.WINDOW:
            src, tag = self.expected.pop(0)
            dtype, shape = self.shapes[tag]
            buf = torch.empty(shape, dtype=dtype)
            self.posted[tag] = (buf, self.pg.recv([buf], src, 2 * tag + 1), src)

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        t = tensor.detach().to("cpu").contiguous()
        if t.dim() > self.MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(f"gloo transport: cannot send a {t.dtype} tensor of {t.dim()} dims (at most {self.MAX_DIMS}; dtypes {_DTYPES})")
        try:
            if self.warm:
                if self.shapes.get(tag) != (t.dtype, tuple(t.shape)):
                    raise ValueError(f"gloo transport: message {tag} is {t.dtype} {tuple(t.shape)} but was {self.shapes.get(tag)} in the first batch; "
                                     "micro-batches must keep their shapes from batch to batch (or use transport=ray)")
                self.pending.append((to, tag, t, self.pg.send([t], to, 2 * tag + 1)))
                return
            self.shapes[tag] = (t.dtype, tuple(t.shape))
            header = torch.full((2 + self.MAX_DIMS,), -1, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            self.pending.append((to, tag, header, t, self.pg.send([header], to, 2 * tag), self.pg.send([t], to, 2 * tag + 1)))
        except RuntimeError as exc:  # a peer already gone fails the send as it is posted
            raise _link_error(exc, self.rank, f"send of message {tag} to stage {to}", 0.0, self.wait_s) from exc

    def recv(self, src: int, tag: int) -> torch.Tensor:
        what = f"receive of message {tag} from stage {src}"
        if self.warm:
            if tag not in self.posted:
                self.expected = [e for e in self.expected if e[1] != tag]
                dtype, shape = self.shapes[tag]
                buf = torch.empty(shape, dtype=dtype)
                self.posted[tag] = (buf, self.pg.recv([buf], src, 2 * tag + 1), src)
            buf, work, _ = self.posted.pop(tag)
            _wait(work, self.rank, what, self.wait_s)
            self._post()
            return buf
        header = torch.empty(2 + self.MAX_DIMS, dtype=torch.int64)
        _wait(self.pg.recv([header], src, 2 * tag), self.rank, what, self.wait_s)
        shape = tuple(int(x) for x in header[2:2 + int(header[1])])
        dtype = _DTYPES[int(header[0])]
        self.shapes[tag] = (dtype, shape)
        out = torch.empty(shape, dtype=dtype)
        _wait(self.pg.recv([out], src, 2 * tag + 1), self.rank, what, self.wait_s)
        return out

    def flush(self) -> None:
        """The batch is done on this stage: wait for its sends to leave."""
        pending, self.pending = self.pending, []
        for to, tag, *rest in pending:
            for work in rest[len(rest) // 2:]:
                _wait(work, self.rank, f"send of message {tag} to stage {to}", self.wait_s)
        if self.posted or self.expected:
            raise RuntimeError(f"gloo transport: the batch ended with {len(self.posted) + len(self.expected)} message(s) not taken")
        self.warm = True

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the group is being given up
            pass

    def close(self) -> None:
        self.pending, self.posted = [], {}
        for fn in (self.pg.abort, self.pg.shutdown):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort: the group is being given up
                pass


def same_node(nodes: Sequence[str]) -> bool:
    """Whether a pipeline's stages (their node ids) all run on one node, so its links can
    stay on loopback.

    >>> same_node(["n1", "n1", "n1"]), same_node(["n1", "n2"])
    (True, False)
    """
    return len(set(nodes)) == 1


def _node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


def _free_port() -> tuple[str, int]:
    import socket

    host = _node_ip()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return host, sock.getsockname()[1]
