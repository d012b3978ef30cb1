"""``raylane run graphsage``: a GNN (GraphSAGE by default; GCN, GAT or GIN) trained on mini-batches made by sampler actors.

The graph (generated, or read from a folder of arrays, its edges made two-way unless
``graph.undirected=false``; what was changed is printed and logged as ``graph_input``) is
split into one METIS part per sampler and put into the object store once. An epoch is a fixed list of batches, each
named by (part, index) and drawn from the training seeds of its part; the driver keeps
``prefetch`` of them in flight on the sampler pool and hands them to the trainer in epoch
order, so sampling runs on the (spot) samplers while the (on-demand) trainer computes.
A sampler lost mid-epoch costs nothing but time: its batch is made again, identically,
by another sampler or its replacement, and the epoch still visits every training seed
exactly once (checked at the end of every epoch). The trainer checkpoints model,
optimizer, random state, epoch and position; a restarted driver goes on from there.
"""

from __future__ import annotations

import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray

from raylane import budget
from raylane import config as cfg
from raylane.budget import Estimate, size
from raylane.actors import gnn_model
from raylane.actors.gnn_sampler import GNNSamplerActor, SamplerConfig
from raylane.actors.graph import ARRAYS, FEATURE_DTYPES, SharedGraph, sbm_graph, to_shared
from raylane.actors.graph_io import load_graph
from raylane.actors.sage import GNNTrainerActor, GNNTrainerConfig
from raylane.actors.sampling import check_fanouts, epoch_plan
from raylane.api import BaseWorkload, Context, DriverConfig, JobSpec, PoolError, RoleSpec, TaskPool, snapshot
from raylane.launch import job_main

SAMPLERS, TRAINER = "gnn_sampler", "gnn_trainer"


@dataclass
class GraphSource:
    """Where the graph comes from, and how its edges are read."""

    path: str | None = None
    """Your graph (null: generate a stochastic-block-model graph): an .npz file, or a folder of .npy files, with arrays x [N, F] real-valued features (finite; stored as float32); edge_index [2, E] integer node ids 0..N-1, row 0 the source and row 1 the target of each edge; y [N] integer class ids 0..C-1 (floats holding whole numbers are converted); train_mask, val_mask, test_mask [N] booleans (0/1 integers are converted). Or a folder with edges.parquet (integer columns src, dst) and nodes.parquet (one row per node in id order: y, the three masks, features as columns x0, x1, ... or a list column x). Local, or any pyarrow URI (s3://, gs://, hdfs://); never pickle."""
    undirected: bool = True
    """true: edges are undirected: each is used both ways (the reverse of an edge listed once is added), duplicates and self-loops are dropped, and the counts are reported. false: edges are used exactly as given, source -> target (a node aggregates only what flows into it); duplicates and self-loops are kept, and counted in the report."""
    nodes: int = cfg.field(5000, ge=16)
    """Generated graph: nodes."""
    avg_degree: float = cfg.field(20.0, gt=0)
    """Generated graph: mean degree (edges are stored in both directions)."""
    classes: int = cfg.field(8, ge=2)
    """Generated graph: classes (blocks)."""
    feature_dim: int = cfg.field(32, ge=1)
    """Generated graph: feature width."""
    homophily: float = cfg.field(0.8, ge=0, le=1)
    """Generated graph: fraction of edges inside a class."""
    feature_signal: float = cfg.field(0.3, ge=0)
    """Generated graph: class signal in the features relative to unit noise (small: features alone are weak)."""
    train_fraction: float = cfg.field(0.5, gt=0, lt=1)
    """Generated graph: share of nodes in the training mask."""
    val_fraction: float = cfg.field(0.25, ge=0, lt=1)
    """Generated graph: share of nodes in the validation mask (the rest is test)."""
    seed: int = 0
    """Generated graph: seed."""

    def validate(self) -> None:
        if self.path is None and self.train_fraction + self.val_fraction >= 1:
            raise ValueError(f"train_fraction + val_fraction = {self.train_fraction + self.val_fraction:g}: must be < 1 to leave test nodes")

    def memory(self) -> list[Estimate]:
        """What building the graph holds on the driver at its peak. Generated: features
        nodes x feature_dim x 12 bytes (drawn as float64, kept as float32); edges nodes x
        avg_degree (stored both ways) x 200 bytes, measured at 4-6M edges: int64 pairs, the
        sort keys and two-way copies of prepare_edges, the CSR and METIS's int32 copy with
        its own work arrays; 64 bytes a node (labels, masks, part, order, indptr). A file:
        its arrays as read, twice (the bytes and the arrays made of them), plus the same
        per-edge and per-node figures, from the headers alone; a layout whose headers
        cannot be read cheaply (Parquet, a URI) is not estimated."""
        if self.path is None:
            nodes, dim, edges = self.nodes, self.feature_dim, self.nodes * self.avg_degree
            node_keys, read = ("graph.nodes",), []
            features = Estimate(f"node features: graph.nodes ({nodes:,}) x graph.feature_dim ({dim}) x 12 bytes", nodes * dim * 12,
                                ("graph.nodes", "graph.feature_dim"))
            edge = Estimate(f"edges: graph.nodes ({nodes:,}) x graph.avg_degree ({self.avg_degree:g}) x 200 bytes", edges * 200,
                            ("graph.nodes", "graph.avg_degree"))
        else:
            shapes = _array_headers(self.path)
            if shapes is None or not shapes["x"][0] or not shapes["edge_index"][0]:  # the loader refuses a shapeless x or edge_index
                return []
            nodes, dim = shapes["x"][0][0], int(np.prod(shapes["x"][0][1:]))
            edges = shapes["edge_index"][0][-1] * (2 if self.undirected else 1)
            given = sum(int(np.prod(s)) * d.itemsize for s, d in shapes.values())
            node_keys = ("graph.path's size",)
            read = [Estimate(f"graph.path's arrays ({size(given)}) read, x 2", 2 * given, node_keys)]
            features = Estimate(f"node features: {nodes:,} nodes x {dim} x 4 bytes (float32)", nodes * dim * 4, node_keys)
            edge = Estimate(f"edges: {edges:,} ({'both ways' if self.undirected else 'as given'}) x 200 bytes", edges * 200, node_keys)
        return [features, edge, *read, Estimate(f"per node: {nodes:,} nodes x 64 bytes", nodes * 64, node_keys)]

    def load(self):
        if self.path is not None:
            return load_graph(self.path)
        return sbm_graph(
            self.nodes, num_classes=self.classes, avg_degree=self.avg_degree, homophily=self.homophily, feature_dim=self.feature_dim,
            feature_signal=self.feature_signal, train_fraction=self.train_fraction, val_fraction=self.val_fraction, seed=self.seed,
        )


def _array_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
    """Shape and dtype of every array of a local .npz or folder of .npy files, from their
    headers (nothing is read); None for any other layout or a file that is not so: the
    loader then reads it and says what is wrong."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix == ".npz":
            out = {}
            with zipfile.ZipFile(p) as z:
                for k in ARRAYS:
                    with z.open(f"{k}.npy") as f:
                        major, _ = np.lib.format.read_magic(f)
                        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                        shape, _, dtype = read(f)
                        if int(np.prod(shape, dtype=np.float64)) * dtype.itemsize > z.getinfo(f"{k}.npy").file_size:
                            return None  # a header claiming more than its member holds: the loader names the corrupt file
                        out[k] = (shape, dtype)
            return out
        if p.is_dir() and all((p / f"{k}.npy").is_file() for k in ARRAYS):
            arrays = {k: np.load(p / f"{k}.npy", mmap_mode="r", allow_pickle=False) for k in ARRAYS}
            return {k: (a.shape, a.dtype) for k, a in arrays.items()}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    return None


@dataclass
class GraphSAGEConfig:
    """Mini-batch GNN training (GraphSAGE by default) with sampler actors (stateless, spot) and one trainer (stateful, on-demand, a GPU where present)."""

    graph: GraphSource = field(default_factory=GraphSource)
    """The graph."""
    fanouts: list[int] = cfg.field(default_factory=lambda: [10, 5])
    """Neighbours sampled per node for each layer, hop 1 first; one entry per layer."""
    batch_size: int = cfg.field(256, ge=1)
    """Seed (training) nodes per batch."""
    model: Literal["sage", "gcn", "gat", "gin"] = "sage"
    """The layer, from PyG: ``sage`` (SAGEConv, mean), ``gcn`` (GCNConv), ``gat`` (GATConv,
    ``heads`` heads concatenated in the hidden layers) or ``gin`` (GINConv over a two-layer
    MLP). sage, gat and gin run each layer only on the nodes the next one reads; GCNConv has
    no such form, so gcn runs every layer over all of a batch's nodes (slower per batch).
    gin sums its neighbours, so its activations grow with the degree: start with lr=1e-3."""
    hidden: int = cfg.field(128, ge=1)
    """Hidden width."""
    heads: int = cfg.field(4, ge=1)
    """Attention heads per hidden layer for model=gat (hidden must be a multiple of it)."""
    layers: int | None = cfg.field(None, ge=1)
    """Message-passing layers; must equal len(fanouts) (null: take it from fanouts)."""
    dropout: float = cfg.field(0.2, ge=0, lt=1)
    """Dropout between layers."""
    lr: float = cfg.field(3e-3, gt=0)
    """Adam learning rate."""
    weight_decay: float = cfg.field(0.0, ge=0)
    """Adam weight decay."""
    feature_dtype: str = cfg.field("float32", choices=FEATURE_DTYPES)
    """Precision of the node features in the object store and in every batch: float16 halves both (and the copy of each batch into the store); the model still computes in float32."""
    samplers: int = cfg.field(2, ge=1)
    """Sampler actors, and METIS parts of the graph (one per sampler)."""
    max_samplers: int = cfg.field(16, ge=1)
    """Most sampler actors the pool may grow to."""
    sampler_cpus: float = cfg.field(0.5, gt=0)
    """CPUs reserved per sampler."""
    trainer_cpus: float = cfg.field(1.0, gt=0)
    """CPUs reserved for the trainer."""
    epochs: int = cfg.field(5, ge=1)
    """Passes over the training nodes."""
    prefetch: int = cfg.field(4, ge=1)
    """Batches in flight on the samplers ahead of the trainer."""
    batches_per_step: int = cfg.field(8, ge=1)
    """Batches per driver step (a step never crosses an epoch end); checkpoints are every driver.checkpoint_every_steps steps."""
    batch_timeout_s: float = cfg.field(120.0, gt=0)
    """Longest wait for one sampled batch or one training call."""
    seed: int = 0
    """Seed of the seed order, the neighbour sampling, the weights and dropout."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=1_000_000, checkpoint_every_steps=5))
    """Run name, stop rules, checkpoints."""

    def validate(self) -> None:
        check_fanouts(self.fanouts)
        if self.layers is not None and self.layers != len(self.fanouts):
            raise ValueError(f"layers={self.layers} but fanouts {list(self.fanouts)} has {len(self.fanouts)} entries: give one fan-out per layer")
        if self.samplers > self.max_samplers:
            raise ValueError(f"samplers ({self.samplers}) must not exceed max_samplers ({self.max_samplers})")
        if self.model == "gat" and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}: model=gat gives each head hidden / heads "
                             f"units (e.g. hidden={self.hidden // self.heads * self.heads or self.heads})")
        if self.model != "gat" and self.heads != 4:
            raise ValueError(f"heads={self.heads} is for model=gat; model={self.model} has no attention heads (drop heads)")


def describe_input(report: dict) -> list[str]:
    """Lines for the terminal on what was found in the graph's edges and done to them
    (``report`` is :attr:`SharedGraph.report`; the run's events.jsonl holds it as ``graph_input``)."""
    r, lines = report, []
    found = f"{r['duplicates']} duplicate edges and {r['self_loops']} self-loops"
    if not r["undirected"]:
        back = f"{r['one_way']} edges have no reverse, so nothing flows back along them" if r["one_way"] else "every edge has its reverse"
        lines.append(f"graph.undirected=false: {r['given']} edges used as given (source -> target), {found} kept; {back}")
    elif not (r["reverses_added"] or r["duplicates"] or r["self_loops"]):
        lines.append(f"graph.undirected=true: {r['given']} edges, already two-way, without duplicates or self-loops")
    else:
        lines.append(f"graph.undirected=true: {r['given']} edges given; added {r['reverses_added']} reverse edges (edges listed one way), "
                     f"dropped {found}: {r['used']} edges used (each pair both ways)")
    if r["isolated"]:
        lines.append(f"warning: {r['isolated']} nodes have no edges ({r['isolated_train']} of them training seeds): the model sees only their own features")
    if r["no_in_edges"] > r["isolated"]:
        lines.append(f"warning: {r['no_in_edges']} nodes have no in-edges ({r['no_in_edges_train']} of them training seeds): no neighbour's features reach them")
    for other in ("val", "test"):
        if r[f"train_and_{other}"]:
            lines.append(f"warning: {r[f'train_and_{other}']} nodes are in both train_mask and {other}_mask: {other} accuracy is measured partly on training nodes")
    return lines


def prepare(c: GraphSAGEConfig) -> SharedGraph:
    """The job's prepare: the graph generated or read once (its memory budget first: an extra
    zero in graph.nodes is terabytes), partitioned and described, before any actor starts."""
    budget.check(GraphSAGEWorkload.name, c.graph.memory())
    graph = to_shared(c.graph.load(), c.samplers, seed=c.seed, feature_dtype=c.feature_dtype, undirected=c.graph.undirected)
    for line in describe_input(graph.report):
        print(f"raylane: graphsage: {line}", file=sys.stderr, flush=True)
    return graph


class GraphSAGEWorkload(BaseWorkload):
    name = "graphsage"
    main_metric = "test_acc"
    guarded_metrics = ("loss",)
    # test_acc, val_acc, eval_s and epochs_done come with the evaluation at an epoch's end
    metrics = ("test_acc", "val_acc", "eval_s", "epochs_done", "train_acc", "loss", "epoch", "batches", "seeds_per_s", "sample_wait_s", "train_s", "train_wait_s", "nodes_per_batch", "samplers", "step_s")
    progress_metrics = ("epoch", "loss", "val_acc", "seeds_per_s")

    def __init__(self, config: GraphSAGEConfig, graph: SharedGraph | None = None):
        """``graph``: the graph :func:`prepare` built; built here when None."""
        self.config = config
        c = config
        self.graph = graph if graph is not None else prepare(config)
        self.plan = epoch_plan([len(s) for s in self.graph.train_seeds], c.batch_size)
        self.n_train = sum(len(s) for s in self.graph.train_seeds)
        self.cursor = 0  # global batch number: epoch * len(plan) + position
        self.coverage = np.zeros(self.graph.num_nodes, dtype=np.int32)
        self.last_eval: dict[str, float] = {}
        self.samplers: TaskPool | None = None
        self.trainer: TaskPool | None = None
        self._graph_ref = None
        self._inflight: dict[int, int] = {}  # global batch number -> sampler ticket
        self._ctx: Context | None = None
        self._waited = 0.0

    # ---------------------------------------------------------------- roles and set-up

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [
            RoleSpec(TRAINER, {"CPU": c.trainer_cpus}, count=1, stateful=True, accelerator="prefer"),
            RoleSpec(SAMPLERS, {"CPU": c.sampler_cpus}, min_count=1, max_count=c.max_samplers, want=c.samplers),
        ]

    def _trainer_config(self) -> GNNTrainerConfig:
        c, g = self.config, self.graph
        return GNNTrainerConfig(in_dim=int(g.x.shape[1]), num_classes=g.num_classes, hidden=c.hidden, layers=len(c.fanouts),
                             dropout=c.dropout, lr=c.lr, weight_decay=c.weight_decay, seed=c.seed, model=c.model, heads=c.heads)

    def _sampler_args(self, key: int) -> tuple[tuple, dict]:
        c = self.config
        sc = SamplerConfig(tuple(c.fanouts), c.batch_size, c.seed, home_part=key % self.graph.num_parts)
        return (sc, self._graph_ref), {}

    def setup(self, ctx: Context) -> None:
        c = self.config
        self._ctx = ctx
        if self.graph.report:  # first: on record even if the actors never start
            ctx.log.event("graph_input", **self.graph.report)  # what describe_input printed when the graph was built
        # One copy in the object store; every actor on a node maps the same pages.
        self._graph_ref = ray.put(self.graph)
        tc = self._trainer_config()
        # Two train calls at the trainer: the next batch starts the moment one is done,
        # not after a round trip through the driver (which shares a core with the samplers).
        self.trainer = ctx.task_pool(TRAINER, GNNTrainerActor, actor_args=lambda key: ((tc, self._graph_ref), {}), call_timeout_s=c.batch_timeout_s, queue_depth=2)
        self.samplers = ctx.task_pool(SAMPLERS, GNNSamplerActor, actor_args=self._sampler_args, call_timeout_s=c.batch_timeout_s, on_timeout="retry")
        self.trainer.wait_ready(timeout_s=180)
        self.samplers.wait_ready(timeout_s=180)
        ctx.log.event("graph", nodes=self.graph.num_nodes, edges=self.graph.num_edges, parts=self.graph.num_parts,
                      train=self.n_train, batches_per_epoch=len(self.plan), part_seeds=[len(s) for s in self.graph.train_seeds])

    # ---------------------------------------------------------------- one step

    @property
    def total_batches(self) -> int:
        return self.config.epochs * len(self.plan)

    def _fill(self, start: int) -> None:
        """Keep batches start .. start+prefetch-1 in flight (never past the last epoch)."""
        assert self.samplers is not None
        stop = min(start + self.config.prefetch, self.total_batches)
        for b in range(start, stop):
            if b not in self._inflight:
                epoch, pos = divmod(b, len(self.plan))
                part, index = self.plan[pos]
                self._inflight[b] = self.samplers.submit("batch", epoch, part, index)

    @property
    def trainer_wait_s(self) -> float:
        """How long a whole-state call of the trainer may take (state, load, evaluation)."""
        return max(300.0, self.config.batch_timeout_s)

    def _await(self, pool: TaskPool, ticket: int, *, other: TaskPool, ref: bool = False) -> Any:
        """The result of ``ticket`` (with ``ref``: and its ObjectRef), keeping ``other``
        moving meanwhile: samplers go on prefetching while the trainer computes, and the
        trainer gets its next queued batch the moment it finishes one while the driver
        waits for a sample."""
        deadline = time.monotonic() + self.config.batch_timeout_s
        while not pool.finished(ticket) and time.monotonic() < deadline:
            other.poll(0.0)
            pool.poll(0.005)
        return pool.gather([ticket], timeout_s=max(0.0, deadline - time.monotonic()), refs=ref)[ticket]

    def step(self, step: int) -> dict[str, Any]:
        assert self.samplers is not None and self.trainer is not None and self._ctx is not None
        c = self.config
        t0 = time.perf_counter()
        epoch, pos = divmod(self.cursor, len(self.plan))
        end = self.cursor + min(c.batches_per_step, len(self.plan) - pos)  # a step never crosses an epoch end
        wait_s = 0.0
        train_tickets, held = [], []
        for b in range(self.cursor, end):
            self._fill(b)
            tw = time.perf_counter()
            batch, ref = self._await(self.samplers, self._inflight.pop(b), other=self.trainer, ref=True)
            wait_s += time.perf_counter() - tw
            part, index = self.plan[b % len(self.plan)]
            if tuple(batch["key"]) != (epoch, part, index):
                raise RuntimeError(f"sampler returned batch {batch['key']} for {(epoch, part, index)}")
            np.add.at(self.coverage, batch["n_id"][: batch["batch_size"]], 1)
            # The trainer reads the sampler's result where it lies: no second copy of 10+ MB
            # through the object store, whose memory traffic slowed the trainer's compute
            # on the next core. Holding the batch here pins its copy on this node until
            # the trainer has read it, so a sampler's node going away cannot take it along.
            train_tickets.append(self.trainer.submit("train", ref, retry=False))
            held.append(batch)
            self._fill(b + 1)
        tw = time.perf_counter()
        results = {t: self._await(self.trainer, t, other=self.samplers) for t in train_tickets}
        del held
        train_wait = time.perf_counter() - tw
        stats = [results[t] for t in train_tickets]
        self.cursor = end
        seeds = sum(s["seeds"] for s in stats)
        elapsed = time.perf_counter() - t0
        metrics: dict[str, Any] = {
            "epoch": epoch + (end - epoch * len(self.plan)) / len(self.plan),
            "batches": self.cursor,
            "loss": float(np.average([s["loss"] for s in stats], weights=[s["seeds"] for s in stats])),
            "train_acc": sum(s["correct"] for s in stats) / max(1, seeds),
            "seeds_per_s": seeds / max(elapsed, 1e-9),
            "sample_wait_s": wait_s,
            "train_s": sum(s["train_s"] for s in stats),  # the trainer's compute on the step's batches
            "train_wait_s": train_wait,
            "nodes_per_batch": float(np.mean([s["nodes"] for s in stats])),
            "samplers": len(self.samplers.actors()),
        }
        if self.cursor % len(self.plan) == 0:
            metrics.update(self._end_epoch(epoch))
        metrics["step_s"] = time.perf_counter() - t0
        # The trainer's idle share of the step's training part: its prefetch queue ran dry.
        span = tw + train_wait - t0
        self._waited = max(0.0, span - sum(s["train_s"] for s in stats)) / max(span, 1e-9)
        return metrics

    def waits(self) -> dict[str, float]:
        """For the pool autoscaler: the share of the last step the trainer's feed waited for samplers."""
        return {SAMPLERS: self._waited}

    def _end_epoch(self, epoch: int) -> dict[str, Any]:
        assert self._ctx is not None
        train = np.concatenate(self.graph.train_seeds)
        seen = self.coverage[train]
        outside = int(self.coverage.sum() - seen.sum())
        coverage = {"epoch": epoch, "train_nodes": int(len(train)), "min_visits": int(seen.min()), "max_visits": int(seen.max()), "visits_outside_train": outside,
                    # the trainer's digest of every batch it trained on so far, in order: equal in two runs that trained on the same batches
                    "trained_digest": self.trainer.call_one("info", timeout_s=self.trainer_wait_s)["fed"]}
        self._ctx.log.event("epoch_coverage", **coverage)
        if coverage["min_visits"] != 1 or coverage["max_visits"] != 1 or outside:
            raise RuntimeError(f"epoch {epoch} did not visit every training seed exactly once: {coverage}")
        self.coverage[:] = 0
        self.last_eval = self.trainer.call_one("evaluate", timeout_s=self.trainer_wait_s)
        return {**self.last_eval, "epochs_done": epoch + 1}

    def progress_of(self, step: int, metrics: dict[str, Any]) -> tuple[float, float, str]:
        """Batches toward epochs x batches per epoch."""
        return self.cursor, self.total_batches, "batches"

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return self.cursor >= self.total_batches

    # ---------------------------------------------------------------- state and faults

    def state_dict(self) -> dict:
        handles = self.trainer.actors()
        if not handles:
            raise PoolError(f"role {TRAINER!r}: the trainer is not live, so its state cannot be checkpointed")
        return {
            # The trainer snapshots its model and writes it itself (the driver never holds it).
            "trainer": snapshot({"0": handles[0]}, timeout_s=self.trainer_wait_s)["0"],
            "cursor": self.cursor,
            "coverage": self.coverage.copy(),
            "last_eval": dict(self.last_eval),
            "plan_len": len(self.plan),
            "model": gnn_model.describe(self._trainer_config()),  # what rebuilds the model outside raylane (raylane export)
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["plan_len"]) != len(self.plan):
            raise ValueError(f"the checkpoint is of a run with {state['plan_len']} batches per epoch, this config makes {len(self.plan)}: "
                             "resume with the same graph, samplers and batch_size, or start a new run name")
        self.trainer.call_one("load_part", state["trainer"], timeout_s=self.trainer_wait_s)  # the trainer reads its own part
        self.cursor = int(state["cursor"])
        self.coverage = np.asarray(state["coverage"], dtype=np.int32).copy()
        self.last_eval = dict(state["last_eval"])
        if self.samplers is not None and self._inflight:
            self.samplers.cancel(self._inflight.values())
        self._inflight = {}



JOB = JobSpec("graphsage", "GraphSAGE on mini-batches from sampler actors over a METIS-partitioned graph; samplers on spot, trainer on demand.", GraphSAGEConfig, GraphSAGEWorkload,
              prepare=prepare, export=gnn_model.export, load_model=gnn_model.load)

if __name__ == "__main__":
    job_main(JOB)
