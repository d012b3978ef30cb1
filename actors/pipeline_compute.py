"""A pipeline stage's compute: its layers, their optimizers and the stashed activations.

The torch part of a stage (:class:`StageCore`), kept apart from the Ray actors that
drive it (:mod:`raylane.actors.pipeline_stage`) so it runs and is tested in one process
without Ray. What is copied into it: its slice of the job's config (:class:`StageConfig`),
then through :meth:`StageCore.load` the layer indices of each chunk it holds (one chunk
per virtual stage; ``v`` chunks for the looped schedules) and, on a restore, those
layers' state from the checkpoint. It keeps, for every micro-batch forwarded and not yet
backwarded, the input and output of that chunk (only the input with recomputation on).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from raylane.actors import gpt
from raylane.actors.lm_factory import LayerFactory
from raylane.actors.pipeline_schedules import Schedule


@dataclass(frozen=True)
class StageConfig:
    """One stage's slice of the job's config."""

    model: gpt.GPTConfig
    """The whole model's shape (a stage builds only its layers, each from its own seed);
    with a ``factory``, only its vocab and seq_len mean anything."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    recompute: bool = False
    """Keep only each chunk's input between forward and backward; run the forward again in the backward."""
    threads: int = 1
    """torch intra-op threads (the CPUs the actor reserves)."""
    link_timeout_s: float | None = None
    """gloo transport: longest one wait on a neighbour stage (a receive, a send's completion) may take before this stage fails with an error naming it, so a dead or stuck peer cannot hang the batch; None: the timeout the driver connects with (the step timeout), which also bounds the group's setup."""
    factory: LayerFactory | None = None
    """The user's model (its layers and loss); None: the built-in GPT of ``model``'s shape."""
    timed: tuple[float, float] | None = None
    """Benchmarks only: every layer is a fixed-time operation of (forward, backward) seconds
    instead of the model's layer, so a schedule's bubble and overhead can be measured
    without compute noise. None: the model's layers."""


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class StageCore:
    """The part of a stage that needs no Ray: layers, optimizers, stashed activations."""

    def __init__(self, config: StageConfig):
        torch.set_num_threads(max(1, config.threads))
        self.config = config
        self.device = device()
        self.chunks: dict[int, torch.nn.Sequential] = {}  # virtual stage -> its layers
        self.layer_ids: dict[int, list[int]] = {}  # virtual stage -> model layer indices
        self.opts: dict[int, torch.optim.Optimizer] = {}  # model layer index -> its optimizer
        self.modules: dict[int, torch.nn.Module] = {}  # model layer index -> layer
        self.last = -1  # the model's last virtual stage (computes the loss)
        self.stash: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}  # (vstage, mb) -> (input, output or None)
        self.peak = 0
        self.busy_s = 0.0  # seconds in forward/backward since the last step
        self.span: tuple[float, float] | None = None  # wall clock of the first op's start and the last op's end
        self.ops: list[tuple[str, int, int, float, float]] = []  # (kind, vstage, mb, start, end) since the last step

    # ------------------------------------------------------------ layers and state

    def load(self, pieces: dict[int, Sequence[int]], last: int, states: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hold the layers ``pieces[vstage]`` (model layer indices); ``last`` is the model's
        last virtual stage; ``states`` maps a layer index (as text) to its saved state."""
        c = self.config
        self.chunks, self.layer_ids, self.opts, self.modules, self.stash = {}, {}, {}, {}, {}
        self.last = int(last)
        for j, ids in sorted(pieces.items()):
            layers = []
            for i in ids:
                if c.timed is not None:
                    layer = TimedLayer(c.model, i, *c.timed)
                else:
                    layer = c.factory.layer(i) if c.factory is not None else gpt.build_layer(c.model, i)
                layer = layer.to(self.device)
                opt = gpt.make_optimizer(layer, c.lr, c.weight_decay)
                if states is not None:
                    gpt.load_layer_state(layer, opt, states[str(i)])
                self.modules[i], self.opts[i] = layer, opt
                layers.append(layer)
            self.chunks[int(j)] = torch.nn.Sequential(*layers)
            self.layer_ids[int(j)] = list(ids)
        return self.where()

    def where(self) -> dict[str, Any]:
        """This process, the chunks it holds and its device (the actor adds its Ray node)."""
        return {"pid": os.getpid(), "pieces": {str(j): ids for j, ids in self.layer_ids.items()}, "device": str(self.device)}

    def state(self) -> dict[str, Any]:
        """Every held layer's parameters and optimizer state, by layer index (as text)."""
        return {str(i): gpt.layer_state(m, self.opts[i]) for i, m in self.modules.items()}

    def load_states(self, states: dict[str, Any]) -> None:
        """Load ``states`` (layer index as text -> state) into the layers held now."""
        if missing := sorted(set(map(str, self.modules)) - set(states), key=int):
            raise ValueError(f"no state given for held layers {missing}")
        for i, m in self.modules.items():
            gpt.load_layer_state(m, self.opts[i], states[str(i)])

    def grads(self) -> dict[str, list[torch.Tensor]]:
        """Every held layer's accumulated gradients (CPU), by layer index (as text)."""
        return {str(i): [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu() for p in m.parameters()] for i, m in self.modules.items()}

    # ------------------------------------------------------------ operations

    def _timed(self, kind: str, vstage: int, mb: int, t0: float) -> None:
        t1 = time.time()
        self.ops.append((kind, vstage, mb, t0, t1))
        self.busy_s += t1 - t0
        self.span = (t0, t1) if self.span is None else (min(self.span[0], t0), t1)

    def forward(self, vstage: int, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """Run chunk ``vstage`` on micro-batch ``mb``; keep what its backward needs. Returns
        the output (detached), or on the model's last virtual stage the loss."""
        t0 = time.time()
        try:
            return self._forward(vstage, mb, x, targets, scale)
        finally:
            self._timed("F", vstage, mb, t0)

    def _forward(self, vstage: int, mb: int, x: torch.Tensor, targets: torch.Tensor | None, scale: float) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only arrays from the object store; never written to
            warnings.simplefilter("ignore", UserWarning)
            x = torch.as_tensor(x).to(self.device)
        inp = x if not x.is_floating_point() else x.detach().requires_grad_(True)
        chunk = self.chunks[vstage]
        if self.config.recompute and vstage != self.last:
            with torch.no_grad():
                out = chunk(inp)
            self.stash[(vstage, mb)] = (inp, None)
        else:
            out = chunk(inp)
            self.stash[(vstage, mb)] = (inp, out)
        self.peak = max(self.peak, len(self.stash))
        if vstage == self.last:
            if targets is None:
                raise ValueError(f"the last virtual stage {vstage} needs the targets of micro-batch {mb}")
            factory = self.config.factory
            loss_fn = factory.loss() if factory is not None else gpt.loss_fn
            loss = loss_fn(out, torch.as_tensor(targets).to(self.device))
            self.stash[(vstage, mb)] = (inp, loss * scale)
            return loss.detach().cpu()
        return out.detach()

    def backward(self, vstage: int, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` through chunk ``vstage``: accumulates the layers'
        gradients and returns the gradient of its input (None on the first chunk)."""
        t0 = time.time()
        try:
            return self._backward(vstage, mb, grad)
        finally:
            self._timed("B", vstage, mb, t0)

    def _backward(self, vstage: int, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        inp, out = self.stash.pop((vstage, mb))
        if out is None:  # recomputation: the forward again, this time with its graph
            out = self.chunks[vstage](inp)
        if vstage == self.last:
            out.backward()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                grad = torch.as_tensor(grad).to(self.device)
            out.backward(grad)
        return inp.grad if inp.is_floating_point() else None

    def step(self, peer_grads: Sequence[dict[str, list[torch.Tensor]]] = ()) -> dict[str, Any]:
        """Average the gradients with the same layers' gradients of the other replicas
        (if any), take one optimizer step per layer, and clear the gradients."""
        if self.stash:
            raise RuntimeError(f"step with {len(self.stash)} micro-batch(es) not backwarded: {sorted(self.stash)[:4]}")
        n = 1 + len(peer_grads)
        if peer_grads:
            for i, m in self.modules.items():
                for k, p in enumerate(m.parameters()):
                    total = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                    for g in peer_grads:
                        total += g[str(i)][k].to(self.device)
                    p.grad = total / n
        for opt in self.opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak, self.peak = self.peak, 0
        busy, span, ops = self.busy_s, self.span, self.ops
        self.busy_s, self.span, self.ops = 0.0, None, []
        # busy and span (wall clock, comparable between the stages of one machine or of
        # clock-synchronised nodes) give the batch's measured bubble: see pipeline_stage.measured_bubble()
        return {"peak_activations": peak, "replicas": n, "busy_s": busy, "span": list(span) if span else None, "ops": ops}

    def run_local(self, sched: Schedule, stage: int, inbox: dict, send, tokens: Any, targets: Any, scale: float, take) -> list[float]:
        """Run this stage's operations of ``sched`` (the step excluded). ``take(key)`` waits
        for an input, ``send(key, tensor, to_stage)`` passes an output on."""
        losses = []
        for op in sched.ops[stage]:
            if op.kind == "S":
                continue
            j = sched.vstage(stage, op.chunk)
            if op.kind == "F":
                x = tokens[op.mb] if j == 0 else take(("F", op.mb, j))
                if j == self.last:
                    losses.append((op.mb, float(self.forward(j, op.mb, x, targets[op.mb], scale))))
                else:
                    send(("F", op.mb, j + 1), self.forward(j, op.mb, x), sched.where(j + 1)[0])
            else:
                g = None if j == self.last else take(("B", op.mb, j))
                gi = self.backward(j, op.mb, g)
                if j > 0:
                    send(("B", op.mb, j - 1), gi.detach(), sched.where(j - 1)[0])
        return [loss for _, loss in sorted(losses)]


class _Timed(torch.autograd.Function):
    """``x * w`` that takes a fixed time forward and backward (time.sleep: on a machine
    with fewer cores than stages, spinning stages would measure the OS scheduler)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        time.sleep(t_fwd)
        ctx.save_for_backward(x, w)
        ctx.t_bwd = t_bwd
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        time.sleep(ctx.t_bwd)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class TimedLayer(torch.nn.Module):
    """Layer ``i`` of a model of :class:`gpt.GPTConfig`'s shapes whose forward and backward
    take ``t_fwd`` and ``t_bwd`` seconds: tokens ``[B, T]`` in layer 0, ``[B, T, D]``
    between layers, logits ``[B, T, vocab]`` out of the last."""

    def __init__(self, c: gpt.GPTConfig, i: int, t_fwd: float, t_bwd: float):
        super().__init__()
        self.c, self.i, self.t_fwd, self.t_bwd = c, i, float(t_fwd), float(t_bwd)
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.i == 0:
            x = (x.float() / self.c.vocab).unsqueeze(-1).expand(*x.shape, self.c.d_model).contiguous()
        y = _Timed.apply(x, self.w, self.t_fwd, self.t_bwd)
        if self.i == self.c.n_layers - 1:
            y = y[..., :1].expand(*y.shape[:-1], self.c.vocab)
        return y
