"""Pipeline stages as Ray actors: how a schedule's operations reach the stages' compute.

Where it lives: any node with the CPUs (and, when present, the GPU) the role asks for;
a stateful role (its layers are trained state), so on-demand nodes first. What is
copied into it: its slice of the job's config (:class:`StageConfig`), then its layers
(:meth:`_StageBase.load`); the layers, their optimizers and the stashed activations are
a :class:`~raylane.actors.pipeline_compute.StageCore`, which needs no Ray.

Two ways to drive the stages through a schedule (:mod:`raylane.actors.pipeline_schedules`):

* ``driver``: :class:`PipelineStage` has one method per operation (``forward``,
  ``backward``, ``step``); the driver submits every operation of every stage in the
  schedule's :func:`~raylane.actors.pipeline_schedules.submission_order`, passing each
  activation and gradient as a Ray object reference, and Ray resolves them. A Ray actor runs one
  caller's calls in submission order, which is what keeps each stage in its schedule.
  Simple, but the driver makes ``2 m v`` calls per stage per batch.
* ``linked``: :class:`LinkedStage` gets its whole list in one :meth:`LinkedStage.run`
  call and sends each output straight to the stage that needs it
  (:meth:`LinkedStage.deliver`, a separate concurrency group, so it is taken while
  ``run`` waits for an input). One driver call per stage per batch.

What a failure means: a stage that dies takes its layers' trained state since the last
checkpoint with it; the others' in-flight work for the batch is dropped (``abort``)
and the job reloads every layer from the checkpoint, re-split over the live stages.

Checkpoints: every stage of the first pipeline writes its own layers as a checkpoint part
(:mod:`raylane.checkpoint_parts`); on load each stage reads only the parts that hold its
layers, so a checkpoint of ``P`` stages loads onto any other number of them.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Sequence

import ray
import torch

from raylane.actors.gloo_link import GlooLink, LinkError, Rendezvous, rendezvous, same_node
from raylane.actors.pipeline_compute import StageConfig, StageCore
from raylane.actors.pipeline_schedules import Schedule, submission_order
from raylane.checkpoint_format import StoredPart
from raylane.checkpoint_parts import CHECKPOINT_GROUPS, CheckpointParts, read_part
from raylane.group.gang import gather_ranks


def _node_id() -> str:
    if not ray.is_initialized():  # asking the runtime context would start a Ray instance
        return "local"
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return "local"


# ---------------------------------------------------------------- actors


_PART_TIMEOUT_S = 300.0  # a replica in another actor's memory, fetched through Ray


def _read(part: Any) -> dict[str, Any]:
    """A checkpoint part's layers: a stored part (read and checked here), a snapshot in
    another actor's memory (an object reference: a replica restored from memory), or given whole."""
    if isinstance(part, StoredPart):
        return read_part(part)
    if isinstance(part, ray.ObjectRef):
        return ray.get(part, timeout=_PART_TIMEOUT_S)
    return part


class _StageBase(CheckpointParts):
    def __init__(self, config: StageConfig):
        self.core = StageCore(config)

    def load(self, pieces: dict[int, Sequence[int]], last: int, states: dict[str, Any] | None = None,
             parts: Sequence[StoredPart | dict] | None = None) -> dict[str, Any]:
        """Hold the layers ``pieces[vstage]``: from ``states`` (layer index as text -> state),
        from checkpoint ``parts`` (stored parts read and checked here, or snapshots given
        whole; only this stage's layers are kept), or fresh when both are None."""
        if parts is not None:
            wanted = {str(i) for ids in pieces.values() for i in ids}
            states = {}
            for part in parts:
                got = _read(part)
                states.update({k: v for k, v in got.items() if k in wanted})
            if missing := sorted(wanted - set(states), key=int):
                raise ValueError(f"the checkpoint parts given to this stage hold no state for layers {missing}")
        self.core.load(pieces, last, states)
        return self.where()

    def export_state(self) -> dict:
        return self.core.state()  # copies, on the CPU

    def import_state(self, state: Any) -> None:
        self.core.load_states(state)

    def where(self) -> dict[str, Any]:
        return {"node": _node_id(), **self.core.where()}

    def state(self) -> dict[str, Any]:
        return self.core.state()

    def grads(self) -> dict[str, list[torch.Tensor]]:
        return self.core.grads()

    def step(self, *peer_grads: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
        return self.core.step(peer_grads)


@ray.remote(concurrency_groups=CHECKPOINT_GROUPS)
class PipelineStage(_StageBase):
    """A stage driven one operation per call (the ``driver`` dispatch)."""

    def forward(self, vstage: int, mb: int, x: Any, targets: Any = None, scale: float = 1.0) -> torch.Tensor:
        return self.core.forward(vstage, mb, x, targets, scale)

    def backward(self, vstage: int, mb: int, grad: Any = None) -> torch.Tensor | None:
        return self.core.backward(vstage, mb, grad)


class Aborted(RuntimeError):
    """A linked stage gave up its batch: another stage of the pipeline failed."""


@ray.remote(concurrency_groups={"inbox": 1, **CHECKPOINT_GROUPS})
class LinkedStage(_StageBase):
    """A stage that runs its whole list per call and sends outputs to its neighbours (the
    ``linked`` dispatch). ``deliver`` and ``abort`` run in their own thread, so they are
    taken while ``run`` waits; everything else runs in order in the default thread.

    Two transports between the stages of a pipeline: ``ray`` (an actor call per tensor,
    ``deliver``; works wherever Ray does) and ``gloo`` (a torch.distributed gloo group
    per pipeline, point-to-point sends as torch.distributed.pipelining makes them: about
    0.06-0.2 ms a hop here against 0.8 ms and more for an actor call, which a schedule
    with many hops per step pays on its critical path)."""

    def __init__(self, config: StageConfig):
        super().__init__(config)
        self.peers: list[Any] = []
        self.index = 0
        self.inbox: dict[tuple, Any] = {}
        self.cv = threading.Condition()
        self.aborted = False
        self.group: Any = None  # GlooLink when the transport is gloo

    def rendezvous(self, local: bool) -> Rendezvous:
        """Where the pipeline's gloo group meets (called on stage 0): a file on this node
        when ``local`` (every stage here, all links on 127.0.0.1), else a port on its address."""
        return rendezvous(local)

    def connect(self, index: int, peers: list[Any], group: tuple[Rendezvous, float] | None = None) -> int:
        """This stage's index in its pipeline and the handles of all the pipeline's stages;
        ``group`` (rendezvous, timeout in seconds) joins a gloo group of the pipeline's
        stages instead of sending through Ray (every stage must be connecting at once)."""
        self.index, self.peers = index, list(peers)
        if self.group is not None:
            self.group.close()
            self.group = None
        if group is not None:
            where, timeout_s = group
            self.group = GlooLink(where, index, len(peers), setup_s=float(timeout_s), wait_s=float(self.core.config.link_timeout_s or timeout_s))
        return index

    @ray.method(concurrency_group="inbox")
    def deliver(self, key: tuple, tensor: Any) -> None:
        with self.cv:
            self.inbox[tuple(key)] = tensor
            self.cv.notify_all()

    @ray.method(concurrency_group="inbox")
    def abort(self) -> None:
        with self.cv:
            self.aborted = True
            self.cv.notify_all()
        if self.group is not None:
            self.group.abort()  # a receive blocked on a peer that failed returns with an error

    def run(self, sched: Schedule, tokens: Any, targets: Any, scale: float, timeout_s: float) -> list[float]:
        """This stage's operations of ``sched`` (micro-batch inputs ``tokens[mb]`` for the
        first chunk, ``targets[mb]`` for the last); returns the losses of the micro-batches
        whose last chunk is here. Raises after ``timeout_s`` without an awaited input."""
        with self.cv:
            self.aborted = False
        me = self.index
        link = self.group
        if link is not None:
            link.begin(incoming(sched, me))

        def take(key: tuple) -> Any:
            if link is not None and key not in self.inbox:
                kind, mb, j = key
                src = sched.where(j - 1 if kind == "F" else j + 1)[0]
                return link.recv(src, _tag(sched, key))
            deadline = time.monotonic() + timeout_s
            with self.cv:
                while key not in self.inbox:
                    if self.aborted:
                        raise Aborted(f"stage {me}: batch aborted while waiting for {key}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"stage {me}: no {key} after {timeout_s:g} s (a neighbour lost?)")
                    self.cv.wait(min(left, 1.0))
                return self.inbox.pop(key)

        def send(key: tuple, tensor: torch.Tensor, to: int) -> None:
            if to == me:
                with self.cv:
                    self.inbox[key] = tensor
            elif link is not None:
                link.send(tensor, to, _tag(sched, key))
            else:
                # numpy crosses the object store without a copy into a pickle; CPU tensors only
                self.peers[to].deliver.remote(key, tensor.cpu().numpy() if tensor.device.type == "cpu" else tensor)

        try:
            losses = self.core.run_local(sched, me, self.inbox, send, tokens, targets, scale, take)
            if link is not None:
                link.flush()
            return losses
        except BaseException:
            self.core.stash.clear()
            with self.cv:
                self.inbox.clear()
            if self.group is not None:
                # Leaving the group closes its connections, so the peers blocked on this
                # stage fail now instead of at their timeout; the next connect makes a new one.
                self.group.close()
                self.group = None
            raise


def incoming(sched: Schedule, stage: int) -> list[tuple[int, int]]:
    """``(source stage, tag)`` of every tensor ``stage`` receives from another stage in one
    batch of ``sched``, in the order it uses them."""
    out = []
    last = sched.virtual_stages - 1
    for op in sched.ops[stage]:
        if op.kind == "S":
            continue
        j = sched.vstage(stage, op.chunk)
        if op.kind == "F" and j > 0 and sched.where(j - 1)[0] != stage:
            out.append((sched.where(j - 1)[0], _tag(sched, ("F", op.mb, j))))
        elif op.kind == "B" and j < last and sched.where(j + 1)[0] != stage:
            out.append((sched.where(j + 1)[0], _tag(sched, ("B", op.mb, j))))
    return out


def _tag(sched: Schedule, key: tuple) -> int:
    """A distinct message tag per (kind, micro-batch, virtual stage) of a batch."""
    kind, mb, j = key
    return ((kind == "B") * sched.m + mb) * sched.virtual_stages + j


# ---------------------------------------------------------------- the driver side


def submit_ops(stages: Sequence[Any], sched: Schedule, tokens: Sequence[Any], targets: Sequence[Any], scale: float) -> list[Any]:
    """``driver`` dispatch of one batch through one pipeline: every F and B of every stage,
    in :func:`submission_order`; activations and gradients are object references. Returns
    the references of the micro-batch losses, in micro-batch order (the steps are left to
    the caller)."""
    outs: dict[tuple, Any] = {}
    losses: dict[int, Any] = {}
    last = sched.virtual_stages - 1
    for s, op in submission_order(sched):
        if op.kind == "S":
            continue
        j = sched.vstage(s, op.chunk)
        if op.kind == "F":
            x = tokens[op.mb] if j == 0 else outs.pop(("F", op.mb, j - 1))
            if j == last:
                losses[op.mb] = stages[s].forward.remote(j, op.mb, x, targets[op.mb], scale)
            else:
                outs[("F", op.mb, j)] = stages[s].forward.remote(j, op.mb, x)
        else:
            g = None if j == last else outs.pop(("B", op.mb, j + 1))
            outs[("B", op.mb, j)] = stages[s].backward.remote(j, op.mb, g)
    return [losses[i] for i in range(sched.m)]


def submit_linked(stages: Sequence[Any], sched: Schedule, tokens: Any, targets: Any, scale: float, timeout_s: float) -> list[Any]:
    """``linked`` dispatch of one batch through one pipeline: one ``run`` per stage.
    Returns each stage's reference (a list of losses on the stage with the last chunk)."""
    first, last = sched.where(0)[0], sched.where(sched.virtual_stages - 1)[0]
    return [h.run.remote(sched, tokens if s == first else None, targets if s == last else None, scale, timeout_s) for s, h in enumerate(stages)]


def connect_linked(pipelines: Sequence[Sequence[Any]], transport: str, timeout_s: float) -> None:
    """Tell every :class:`LinkedStage` its place and peers; with ``transport="gloo"`` each
    pipeline's stages also form a gloo group (stage 0 hosts its rendezvous), on loopback
    when all of that pipeline's stages share a node (:mod:`raylane.actors.gloo_link`)."""
    if transport not in ("ray", "gloo"):
        raise ValueError(f"transport must be 'ray' or 'gloo', got {transport!r}")
    groups: list[Any] = [None] * len(pipelines)
    if transport == "gloo":
        nodes = [[w["node"] for w in ray.get([h.where.remote() for h in stages], timeout=timeout_s)] for stages in pipelines]
        places = ray.get([stages[0].rendezvous.remote(same_node(n)) for stages, n in zip(pipelines, nodes)], timeout=timeout_s)
        groups = [(where, timeout_s) for where in places]
    calls = [h.connect.remote(s, list(stages), groups[r]) for r, stages in enumerate(pipelines) for s, h in enumerate(stages)]
    ray.get(calls, timeout=timeout_s + 30)


def pieces_for(sched: Schedule, ranges: Sequence[range]) -> list[dict[int, list[int]]]:
    """Per stage: ``{virtual stage: layer indices}`` from the ranges of the virtual stages."""
    if len(ranges) != sched.virtual_stages:
        raise ValueError(f"{len(ranges)} layer ranges for {sched.virtual_stages} virtual stages")
    out: list[dict[int, list[int]]] = [{} for _ in range(sched.p)]
    for j, r in enumerate(ranges):
        s, _ = sched.where(j)
        out[s][j] = list(r)
    return out


def stage_broken(exc: BaseException) -> bool:
    """A stage's error that means its pipeline broke (a peer failed, died or went silent),
    not a bug in the stage: the gang's ``broken`` predicate for stages."""
    return isinstance(exc, (Aborted, LinkError, TimeoutError, ConnectionError))


def train_batch(pipelines: Sequence[Sequence[Any]], sched: Schedule, batches: Sequence[tuple[Any, Any]], *, dispatch: str, timeout_s: float,
                step: bool = True, gather: Callable[..., dict[int, Any]] | None = None) -> dict[str, Any]:
    """One batch through every pipeline replica, then (``step``) the gradients of each
    stage averaged over the replicas and one optimizer step on every stage.

    ``batches[r]`` is replica ``r``'s ``(tokens, targets)``, each shaped ``[m, b, T]``.
    Each micro-batch's loss is scaled by ``1/m`` before its backward, so a replica's
    gradient is that of its mean loss, and the replicas' average that of the whole batch.
    Returns ``{"losses": [m floats per replica], "steps": [per stage]}``.

    Stage ``s`` of replica ``r`` is rank ``r * p + s``. ``gather`` waits for the ranks'
    calls and raises one error: the stages' gang's :meth:`~raylane.group.Gang.gather`
    (which also kills a stage still stuck after the grace period), or by default
    :func:`~raylane.group.gang.gather_ranks` for stages no gang owns. The error is
    ``GroupLost`` when a stage was lost or the pipeline broke, a grouped ``WorkError``
    when a stage's code raised. At the first failure the linked stages are told to
    abort, so none waits out its timeout.
    """
    if dispatch not in ("driver", "linked"):
        raise ValueError(f"dispatch must be 'driver' or 'linked', got {dispatch!r}")
    scale = 1.0 / sched.m
    p, last = sched.p, sched.where(sched.virtual_stages - 1)[0]
    calls: dict[int, list[Any]] = {r * p + s: [] for r in range(len(pipelines)) for s in range(p)}
    for r, (stages, (tokens, targets)) in enumerate(zip(pipelines, batches)):
        if dispatch == "driver":
            calls[r * p + last] += submit_ops(stages, sched, [ray.put(t) for t in tokens], [ray.put(t) for t in targets], scale)
        else:
            for s, ref in enumerate(submit_linked(stages, sched, tokens, targets, scale, timeout_s)):
                calls[r * p + s].append(ref)
    if step:
        grads = [[h.grads.remote() for h in stages] for stages in pipelines] if len(pipelines) > 1 else []
        for r, stages in enumerate(pipelines):
            for s, h in enumerate(stages):
                calls[r * p + s].append(h.step.remote(*[grads[q][s] for q in range(len(pipelines)) if q != r]))

    def abort() -> None:
        if dispatch == "linked":
            for stages in pipelines:
                for h in stages:
                    h.abort.remote()

    wait = gather or functools.partial(gather_ranks, broken=stage_broken, rank_name="stage")
    out = wait({k: v for k, v in calls.items() if v}, what="train_batch", timeout_s=timeout_s, grace_s=min(10.0, timeout_s), on_failure=abort)
    if dispatch == "driver":
        losses = [[float(x) for x in out[r * p + last][: sched.m]] for r in range(len(pipelines))]
    else:
        losses = [list(out[r * p + last][0]) for r in range(len(pipelines))]
    steps = [out[k][-1] for k in sorted(calls)] if step else []
    return {"losses": losses, "steps": steps}


def measured_bubble(steps: Sequence[dict[str, Any]]) -> float:
    """The share of stage-time idle in one batch of one pipeline: ``1 - sum(busy) / (p x
    makespan)`` from the stages' ``step`` results, makespan from the first operation's
    start to the last one's end on any stage (waits for inputs count as bubble; the
    driver's own round trip does not)."""
    spans = [s["span"] for s in steps if s.get("span")]
    if not spans:
        return float("nan")
    makespan = max(b for _, b in spans) - min(a for a, _ in spans)
    return 1.0 - sum(s["busy_s"] for s in steps) / (len(steps) * makespan) if makespan > 0 else 0.0
