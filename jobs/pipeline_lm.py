"""``raylane run pipeline_lm``: a GPT-style language model split over pipeline-stage actors.

The model (:mod:`raylane.actors.gpt`: embedding, transformer blocks, head, each a layer
with its own optimizer) is cut into ``stages * chunks`` contiguous pieces by measured
layer cost and the speed of the node each stage landed on; every step runs one batch of
``micro_batches`` micro-batches through each of ``replicas`` pipelines in the chosen
schedule (gpipe, 1f1b, interleaved, bfs), averages each layer's gradients over the
replicas and takes one optimizer step. The text is generated in the package
(:mod:`raylane.actors.corpus`), or read from the user's token file, and the layers may be
the user's own (:mod:`raylane.jobs.pipeline_inputs`); batches are drawn from ``(seed,
step, replica)``, so a recovered or resumed run trains on exactly the batches an
uninterrupted one would. ``raylane run pipeline`` is the same job.

Checkpoints hold every layer's parameters and optimizer state by layer index, so they
can be cut differently on load. A lost stage (its actor or its node): the others drop
the batch, the stages' gang replaces the stage where capacity allows, the layers are split again
over the stages that are live (fewer per pipeline if no replacement fits) and every layer
is reloaded from the last checkpoint. When capacity comes back the pipeline is split
again over the larger gang at the next step, from the live state (nothing is lost).

    raylane run pipeline_lm
    raylane run pipeline_lm --set schedule=interleaved --set chunks=2 --set stages=2 --set micro_batches=4
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from raylane import config as cfg
from raylane.actors import corpus, gpt
from raylane.actors import pipeline_schedules as S
from raylane.actors.pipeline_split import split_virtual, stage_loads
from raylane.actors.pipeline_stage import LinkedStage, PipelineStage, StageConfig, connect_linked, measured_bubble, pieces_for, stage_broken, train_batch
from raylane.api import BaseWorkload, CallTimeoutError, Context, DriverConfig, Gang, JobSpec, PoolError, RoleSpec
from raylane.launch import job_main
from raylane.preemption import NodeLeaving
from raylane.actors.lm_factory import LayerFactory
from raylane.jobs.pipeline_inputs import TokenData, Tokens, assemble, greedy, check_budget, load_factory, load_tokens
from raylane.jobs.pipeline_state import describe, export as export_model, held_layers, load as load_model, parts_for, snapshot_stages

log = logging.getLogger(__name__)

ROLE = "pipeline_stage"


@dataclass
class ModelShape:
    """The model: the built-in GPT-style model of this shape, or your own (``factory``)."""

    seq_len: int = cfg.field(64, ge=2)
    """Tokens per sequence."""
    d_model: int = cfg.field(128, ge=8)
    """Width of the residual stream."""
    n_heads: int = cfg.field(4, ge=1)
    """Attention heads (must divide d_model)."""
    n_blocks: int = cfg.field(4, ge=1)
    """Transformer blocks; the model has n_blocks + 2 layers (embedding and head)."""
    seed: int = 0
    """Seed of the initial weights."""
    factory: str | None = None
    """Your own model, by import path (package.module:NAME or path/to/file.py:NAME) of
    ``factory(spec) -> (layers, loss)``: ``spec`` has vocab and seq_len, ``layers`` is an
    ordered list of torch.nn.Module (the first takes token ids [B, T], each next the
    previous output) and ``loss(output, targets [B, T])`` a scalar. The layers are cut over
    the stages by measured cost like the built-in model's. d_model, n_heads and n_blocks
    shape the built-in model only, so they are refused with a factory."""

    def validate(self) -> None:
        gpt.check(self.gpt(corpus.VOCAB))
        changed = [k for k in ("d_model", "n_heads", "n_blocks") if getattr(self, k) != getattr(ModelShape, k)]
        if self.factory is not None and changed:
            raise ValueError(f"factory={self.factory!r} builds the whole model, so {', '.join(changed)} would be ignored; drop them")

    def gpt(self, vocab: int) -> gpt.GPTConfig:
        return gpt.GPTConfig(vocab=vocab, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads, n_blocks=self.n_blocks, seed=self.seed)


@dataclass
class PipelineLMConfig:
    """Pipeline-parallel training of a small GPT-style model on generated text."""

    model: ModelShape = field(default_factory=ModelShape)
    """The model: the built-in GPT's shape, or your own factory."""
    data: TokenData = field(default_factory=TokenData)
    """The tokens: generated text, or your .npy of token ids or UTF-8 text file (data.path)."""
    stages: int = cfg.field(2, ge=1)
    """Stage actors per pipeline."""
    schedule: str = cfg.field("1f1b", choices=S.SCHEDULES)
    """Order of forward and backward micro-batch operations on each stage."""
    chunks: int = cfg.field(1, ge=1)
    """Model pieces per stage (virtual stages): more than 1 only for interleaved and bfs."""
    micro_batches: int = cfg.field(4, ge=1)
    """Micro-batches per batch (per replica)."""
    micro_batch_size: int = cfg.field(8, ge=1)
    """Sequences per micro-batch."""
    replicas: int = cfg.field(1, ge=1)
    """Pipelines trained data-parallel (gradients averaged per layer before the step)."""
    dispatch: str = cfg.field("linked", choices=("linked", "driver"))
    """linked: each stage gets its operation list once per batch and sends outputs to its neighbours; driver: the driver submits every operation."""
    transport: str = cfg.field("gloo", choices=("gloo", "ray"))
    """Between linked stages: gloo (a torch.distributed gloo group per pipeline, as torch's own pipelining uses: ~0.1 ms a hop; it opens TCP ports between the stage actors that Ray's token authentication does not cover) or ray (an actor call per tensor: ~1 ms a hop, only Ray's own connections)."""
    recompute: bool = False
    """Keep only each piece's input between forward and backward and run the forward again in the backward."""
    split: str = cfg.field("measured", choices=("measured", "even"))
    """How layers are weighed when cut into pieces: measured forward+backward time per layer, or all equal."""
    lr: float = cfg.field(3e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = cfg.field(0.0, ge=0)
    """AdamW weight decay."""
    stage_cpus: float = cfg.field(1.0, gt=0)
    """CPUs each stage reserves (its torch threads: the whole part, at least 1)."""
    text_chars: int = cfg.field(200_000, ge=1000)
    """Characters of generated text (without data.path)."""
    val_fraction: float = cfg.field(0.1, gt=0, lt=1)
    """Share of the text held out for the final validation loss."""
    seed: int = 0
    """Seed of the text and of the batch order."""
    target_loss: float = cfg.field(0.0, ge=0)
    """Stop once a step's mean training loss is at or below this (0: run all steps)."""
    step_timeout_s: float = cfg.field(120.0, gt=0)
    """Longest one step may take before it counts as a failure (a stage lost without an error)."""
    start_timeout_s: float = cfg.field(120.0, gt=0)
    """Longest to wait for stage actors to start."""
    replace_timeout_s: float = cfg.field(30.0, gt=0)
    """After a lost stage, how long to wait for a replacement before the layers are cut over fewer stages."""
    link_timeout_s: float = cfg.field(0.0, ge=0)
    """transport=gloo: longest one wait on a neighbour stage may take before the stage fails naming it (0: step_timeout_s)."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=400, checkpoint_every_steps=100))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        S.make(self.schedule, self.stages, self.micro_batches, self.chunks)  # the schedule's own checks, with its messages

    def inputs(self) -> tuple[Tokens, gpt.GPTConfig, LayerFactory | None, int]:
        """The tokens, the model's shape, the user's factory (or None) and the number of
        layers, each read and checked here, before Ray starts."""
        tokens = load_tokens(self.data, text_chars=self.text_chars, seed=self.seed)
        shape = self.model.gpt(tokens.vocab)
        factory, n_layers = None, shape.n_layers
        if self.model.factory is not None:
            factory, n_layers = load_factory(self.model.factory, vocab=tokens.vocab, seq_len=self.model.seq_len, seed=self.model.seed)
        if self.stages * self.chunks > n_layers:
            what = f"model {self.model.factory!r} has {n_layers}" if factory else f"the model has only {n_layers} layers (n_blocks + 2)"
            raise ValueError(f"stages x chunks = {self.stages} x {self.chunks} = {self.stages * self.chunks} pieces but {what}; "
                             "use fewer stages or chunks" + ("" if factory else ", or more blocks"))
        return tokens, shape, factory, n_layers


# ---------------------------------------------------------------- layout (no Ray)


@dataclass(frozen=True)
class Layout:
    """Which actor holds which layers: ``pipelines[r][s]`` is stage ``s`` of replica ``r``."""

    sched: S.Schedule
    pipelines: tuple[tuple[Any, ...], ...]
    pieces: tuple[dict[int, list[int]], ...]
    """Per stage position: ``{virtual stage: layer indices}`` (the same in every replica)."""
    speeds: tuple[float, ...]
    loads: tuple[float, ...]

    @property
    def actors(self) -> list[Any]:
        return [h for p in self.pipelines for h in p]


def fit_schedule(name: str, p: int, m: int, v: int) -> S.Schedule:
    """The schedule ``name`` on the most stages ``<= p`` it accepts (interleaved needs ``m``
    to be a multiple of the stages; after a loss there may be fewer stages than asked)."""
    for q in range(p, 0, -1):
        try:
            return S.make(name, q, m, v)
        except ValueError:
            if q == 1:
                raise
    raise AssertionError("unreachable")


def make_layout(name: str, m: int, v: int, replicas: int, actors: list[Any], speeds: list[float], costs: list[float], want_stages: int) -> Layout:
    """Deal ``actors`` (fastest first) over ``replicas`` pipelines of as many stages as
    there are actors for (at most ``want_stages``) and cut the layers by cost and speed.
    A stage position's speed is its slowest replica's, so replicas hold the same layers."""
    p = min(want_stages, len(actors) // replicas, len(costs) // v)
    if p < 1:
        raise ValueError(f"{len(actors)} live stage actor(s) cannot make {replicas} pipeline(s); need at least {replicas}")
    sched = fit_schedule(name, p, m, v)
    p = sched.p
    order = sorted(range(len(actors)), key=lambda k: -speeds[k])
    pipes = [[actors[order[r + replicas * s]] for s in range(p)] for r in range(replicas)]
    pos_speed = [min(speeds[order[r + replicas * s]] for r in range(replicas)) for s in range(p)]
    ranges = split_virtual(costs, pos_speed, v)
    loads = stage_loads(costs, [pos_speed[j % p] for j in range(len(ranges))], ranges)
    stage_load = [sum(loads[j] for j in range(len(ranges)) if j % p == s) for s in range(p)]
    return Layout(sched, tuple(tuple(x) for x in pipes), tuple(pieces_for(sched, ranges)), tuple(pos_speed), tuple(stage_load))


# ---------------------------------------------------------------- the workload


def prepare(c: PipelineLMConfig) -> tuple[Tokens, gpt.GPTConfig, LayerFactory | None, int]:
    """The job's prepare: the budget checked, then the tokens read (or generated) and the
    model checked, once, before Ray starts."""
    check_budget(c)  # before inputs(): it generates or reads every token on the driver
    return c.inputs()


class PipelineLMWorkload(BaseWorkload):
    name = "pipeline_lm"
    main_metric = "loss"
    guarded_metrics = ("loss",)
    metrics = ("loss", "tokens_per_s", "step_s", "stages", "replicas", "peak_activations", "bubble")
    progress_metrics = ("loss", "tokens_per_s")

    def __init__(self, config: PipelineLMConfig, inputs: tuple[Tokens, gpt.GPTConfig, LayerFactory | None, int] | None = None):
        """``inputs``: the tokens, model shape, factory and layer count :func:`prepare` read; read here when None."""
        self.config = config
        self.tokens, self.model, self.factory, self.n_layers = inputs if inputs is not None else prepare(config)
        self.train_tokens, self.val_tokens = corpus.split(self.tokens.ids, config.val_fraction)
        if len(self.train_tokens) < self.model.seq_len + 2 or len(self.val_tokens) < self.model.seq_len + 1:
            what = f"text_chars={config.text_chars}" if config.data.path is None else f"data.path {config.data.path!r} ({len(self.tokens.ids)} tokens)"
            raise ValueError(f"{what} with val_fraction={config.val_fraction} leaves too little text for seq_len={self.model.seq_len}")
        self.costs: list[float] = []
        self.gang: Gang | None = None  # elastic: rank r * p + s is stage s of replica r in the current layout
        self.ctx: Context | None = None
        self.layout: Layout | None = None
        self._kept: dict[str, Any] | None = None  # layer states read for a hand-off that failed, until reloaded
        self.last_loss = float("nan")

    def roles(self) -> list[RoleSpec]:
        c = self.config
        n = c.stages * c.replicas
        return [RoleSpec(ROLE, {"CPU": c.stage_cpus}, min_count=c.replicas, max_count=n, want=n, stateful=True, accelerator="prefer")]

    def setup(self, ctx: Context) -> None:
        c = self.config
        self.ctx = ctx
        layers = self.factory.build()[0] if self.factory is not None else None
        self.costs = gpt.measure_costs(self.model, c.micro_batch_size, layers) if c.split == "measured" else [1.0] * self.n_layers
        ctx.log.event("layer_costs", seconds=[round(x, 6) for x in self.costs], split=c.split)
        stage = StageConfig(self.model, lr=c.lr, weight_decay=c.weight_decay, recompute=c.recompute, threads=max(1, int(c.stage_cpus)), factory=self.factory,
                            link_timeout_s=c.link_timeout_s or None)
        cls = LinkedStage if c.dispatch == "linked" else PipelineStage
        self.gang = ctx.gang(ROLE, cls, actor_args=lambda key: ((stage,), {}), start_timeout_s=c.start_timeout_s, elastic=True, broken=stage_broken, rank_name="stage")
        self.gang.wait_ready(timeout_s=c.start_timeout_s)
        self._relayout(states=None)

    # ------------------------------------------------------------ layout and state

    def _relayout(self, states: dict[str, Any] | None, parts: dict[str, Any] | None = None) -> None:
        """Cut the layers over the gang's live actors and deal them their ranks; load
        ``states`` (layer index -> state) into them, or the checkpoint's ``parts`` (each
        stage reads those that hold its layers), or the fresh initial layers when both are None."""
        assert self.gang is not None and self.ctx is not None
        c = self.config
        live = self.gang.actors()
        where = ray.get([h.where.remote() for h in live], timeout=c.start_timeout_s)
        known = {n.node_id: n.speed for n in self.ctx.cluster.nodes}
        speeds = [known.get(w["node"], 1.0) for w in where]
        layout = make_layout(c.schedule, c.micro_batches, c.chunks, c.replicas, live, speeds, self.costs, c.stages)
        last = layout.sched.virtual_stages - 1
        loads = []
        held = None if parts is None else held_layers(parts, self.n_layers)
        for stages in layout.pipelines:
            for s, h in enumerate(stages):
                ids = [i for piece in layout.pieces[s].values() for i in piece]
                if held is not None:
                    loads.append(h.load.remote(layout.pieces[s], last, None, parts_for(parts, held, ids)))
                    continue
                needed = None if states is None else {str(i): states[str(i)] for i in ids}
                loads.append(h.load.remote(layout.pieces[s], last, needed))
        ray.get(loads, timeout=c.start_timeout_s)
        self.gang.deal([h for stages in layout.pipelines for h in stages])
        if c.dispatch == "linked":
            connect_linked(layout.pipelines, c.transport, c.step_timeout_s)
        self.layout = layout
        self.ctx.log.event(
            "pipeline_layout", stages=layout.sched.p, replicas=len(layout.pipelines), schedule=layout.sched.name, chunks=layout.sched.v,
            pieces=[{str(j): ids for j, ids in piece.items()} for piece in layout.pieces], speeds=list(layout.speeds),
            stage_seconds=[round(x, 6) for x in layout.loads], nodes=[w["node"] for w in where],
        )

    def _gather_state(self) -> dict[str, Any]:
        """Every layer's state, from the first pipeline (replicas hold the same values)."""
        assert self.layout is not None
        parts = ray.get([h.state.remote() for h in self.layout.pipelines[0]], timeout=self.config.step_timeout_s)
        out: dict[str, Any] = {}
        for part in parts:
            out.update(part)
        missing = [i for i in range(self.n_layers) if str(i) not in out]
        if missing:
            raise RuntimeError(f"the pipeline's stages hold no state for layers {missing}")
        return out

    def state_dict(self) -> dict:
        if self.layout is None and self._kept is not None:  # read for a hand-off that failed: it goes through the driver
            return {"layers": self._kept, "last_loss": self.last_loss, "model": describe(self.model, self.factory)}
        if self.layout is None:
            raise PoolError("pipeline_lm: no layout to checkpoint (stages lost)")
        # Every stage of the first pipeline writes its own layers (the driver never holds the model).
        return {**snapshot_stages(self.layout.pipelines[0], self.layout.pieces, self.config.step_timeout_s), "last_loss": self.last_loss, "model": describe(self.model, self.factory)}

    def load_state_dict(self, state: dict) -> None:
        self.last_loss = float(state.get("last_loss", float("nan")))
        if "stages" in state:  # parts: each stage of the new cut reads those holding its layers
            self._relayout(states=None, parts=state)
            assert self.ctx is not None and self.layout is not None
            if len(state["stages"]) != self.layout.sched.p:
                self.ctx.log.event("pipeline_recut", saved_stages=len(state["stages"]), stages=self.layout.sched.p)
        else:
            layers = state["layers"]
            missing = [i for i in range(self.n_layers) if str(i) not in layers]
            if missing:
                raise ValueError(f"the checkpoint has no state for layers {missing}: it is not of this model ({self.n_layers} layers)")
            self._relayout(states=layers)
        self._kept = None

    # ------------------------------------------------------------ steps

    def _maybe_grow(self) -> None:
        """Capacity came back: spread the layers over more stages, from the live state."""
        assert self.gang is not None and self.layout is not None
        c = self.config
        self.gang.refresh()  # take in replacements that became ready since the last step
        live = self.gang.actors()
        if self.layout.sched.p < c.stages and len(live) // c.replicas > self.layout.sched.p:
            before = self.layout.sched.p
            self._relayout(states=self._gather_state())
            assert self.ctx is not None
            self.ctx.log.event("pipeline_grow", stages_before=before, stages=self.layout.sched.p)

    def on_event(self, event: Any) -> bool:
        """A preemption notice for a node that holds stages: hand its layers over now, from
        the live state, to the stages elsewhere (the gang starts replacements where there is
        room; the next steps grow onto them), so the node can go without a failed step or a
        replay. Returns True (checkpoint at once) when there is nowhere to hand them, or the
        hand-off failed (the state read from the stages is what that checkpoint holds)."""
        if not isinstance(event, NodeLeaving) or self.layout is None or self.gang is None:
            return False
        c = self.config
        live = self.gang.actors()
        where = ray.get([h.where.remote() for h in live], timeout=c.step_timeout_s)
        leaving = sum(1 for w in where if w["node"] == event.node_id)
        if not leaving:
            return False
        staying = len(live) - leaving
        assert self.ctx is not None
        if staying < c.replicas:  # not one stage per pipeline would be left: keep going and let recovery cut over
            self.ctx.log.event("pipeline_handoff", node=event.node_id, done=False, reason=f"{staying} stage(s) off the node, {c.replicas} pipeline(s)")
            return True
        before = self.layout.sched.p
        states = self._gather_state()
        self.gang.evacuate(event.node_id, "preemption notice: its layers are handed to the other stages")
        try:
            self._relayout(states=states)
        except Exception as exc:  # noqa: BLE001 - keep the gathered state: it is checkpointed now and reloaded on recovery
            self.layout, self._kept = None, states
            self.ctx.log.event("pipeline_handoff", node=event.node_id, done=False, reason=f"{type(exc).__name__}: {exc}"[:300])
            return True
        self.ctx.log.event("pipeline_handoff", node=event.node_id, done=True, stages_before=before, stages=self.layout.sched.p,
                           seconds_left=event.seconds_left())
        return False

    def step(self, step: int) -> dict[str, Any]:
        c = self.config
        if self.layout is None:
            raise PoolError("pipeline_lm: no layout (stages lost, or a hand-off that failed): recovering from the last checkpoint")
        self._maybe_grow()
        lay = self.layout
        batches = []
        for r in range(len(lay.pipelines)):
            x, y = corpus.batch(self.train_tokens, c.micro_batches, c.micro_batch_size, self.model.seq_len, seed=c.seed, step=step, replica=r)
            batches.append((torch.from_numpy(x), torch.from_numpy(y)))
        t0 = time.perf_counter()
        assert self.gang is not None
        out = train_batch(lay.pipelines, lay.sched, batches, dispatch=c.dispatch, timeout_s=c.step_timeout_s, gather=self.gang.gather)
        seconds = time.perf_counter() - t0
        losses = [x for per in out["losses"] for x in per]
        self.last_loss = float(np.mean(losses))
        tokens = len(lay.pipelines) * c.micro_batches * c.micro_batch_size * self.model.seq_len
        return {
            "loss": self.last_loss, "tokens_per_s": tokens / seconds, "step_s": seconds, "stages": lay.sched.p,
            "replicas": len(lay.pipelines), "peak_activations": max(s["peak_activations"] for s in out["steps"]),
            "bubble": measured_bubble(out["steps"][: lay.sched.p]),
        }

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return self.config.target_loss > 0 and metrics["loss"] <= self.config.target_loss

    def finish(self, ctx: Context) -> None:
        """At the end: the held-out loss of the whole model (assembled here from the
        stages' layers) in ``final.json`` and a greedy sample in ``sample.txt``."""
        layers = self._gather_state()
        model = assemble(self.model, layers, self.factory)
        loss_fn = self.factory.loss() if self.factory is not None else gpt.loss_fn
        x, y = corpus.eval_windows(self.val_tokens, self.model.seq_len, limit=64)
        with torch.no_grad():
            val = float(loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)))
        _write(Path(ctx.run_dir) / "final.json", json.dumps({"val_loss": val, "train_loss": self.last_loss}, indent=1).encode())
        ctx.log.event("final", val_loss=val)
        if self.factory is None and self.tokens.kind != "npy":  # text in, text out: a greedy sample
            prompt, decode = (corpus.encode("the cat "), corpus.decode) if self.tokens.kind == "generated" else \
                (self.val_tokens[:8], lambda t: bytes(int(v) for v in t).decode("utf-8", errors="replace"))
            text = decode(greedy(model, self.model, prompt, 160))
            _write(Path(ctx.run_dir) / "sample.txt", text.encode())
            log.info("pipeline_lm: held-out loss %.4f; sample: %r", val, text[:80])

    def recover(self, ctx: Context, error: BaseException) -> None:
        """After a lost stage: replace dead stages where capacity allows, and cut the layers
        over whatever is live; the driver then reloads every layer from the checkpoint."""
        assert self.gang is not None
        self.ctx = ctx
        c = self.config
        self.gang.probe(timeout_s=c.start_timeout_s)  # evicts the dead (the gang's gather evicted those it saw); replacements start
        try:
            self.gang.wait_ready(timeout_s=c.replace_timeout_s)
        except CallTimeoutError as exc:  # no room for a replacement now: go on with fewer stages
            ctx.log.event("pipeline_shrink", live=len(self.gang.actors()), reason=str(exc)[:300])
        if len(self.gang.actors()) < c.replicas:
            self.gang.wait_for(c.replicas, timeout_s=c.start_timeout_s)
        self.layout = None


def _write(path: Path, payload: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


class PipelineWorkload(PipelineLMWorkload):
    name = "pipeline"


JOB = JobSpec("pipeline_lm", "A GPT-style model split over pipeline-stage actors (gpipe, 1f1b, interleaved, bfs); re-split over live stages after a loss.", PipelineLMConfig, PipelineLMWorkload,
              prepare=prepare, export=export_model, load_model=load_model)
PIPELINE = JobSpec("pipeline", "pipeline_lm by its general name: your layers (model.factory) on your tokens (data.path), or the built-in GPT on generated text.",
                   PipelineLMConfig, PipelineWorkload, prepare=prepare, export=export_model, load_model=load_model)

if __name__ == "__main__":
    job_main(JOB)
