"""The GNN (PyG's ``SAGEConv``, ``GCNConv``, ``GATConv`` or ``GINConv`` layers) and the
trainer actor that fits it on sampled batches.

The trainer is the job's stateful role: model, optimizer, and the torch random state
(dropout) live here and are what a checkpoint holds. It trains on one sampled batch per
call and evaluates with full-neighbourhood inference over the whole graph (the graph's
CSR is already a sparse adjacency, so ``SAGEConv`` aggregates with one sparse product per
layer and never materialises a message per edge).
"""

from __future__ import annotations

import hashlib
import io
import os
import zlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import ray
import torch
import torch.nn.functional as F
from torch import nn

from raylane.actors.allocator import keep_freed_memory
from raylane.actors.graph import SharedGraph
from raylane.checkpoint_parts import CHECKPOINT_GROUPS, CheckpointParts



def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


MODELS = ("sage", "gcn", "gat", "gin")
"""PyG layer per name: GraphSAGE (mean), GCN (symmetric normalisation, self-loops), GAT
(multi-head attention; hidden layers concatenate their heads) and GIN (a two-layer MLP
after the sum of the neighbours)."""


def _conv(kind: str, a: int, b: int, last: bool, heads: int) -> nn.Module:
    from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

    if kind == "sage":
        return SAGEConv(a, b)
    if kind == "gcn":
        return GCNConv(a, b)
    if kind == "gat":
        return GATConv(a, b, heads=1) if last else GATConv(a, b // heads, heads=heads)
    if kind == "gin":
        return GINConv(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b)))
    raise ValueError(f"model {kind!r} is not one of {', '.join(MODELS)}")


class GNN(nn.Module):
    """``layers`` message-passing layers of one kind (:data:`MODELS`), ReLU and dropout
    between them."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float = 0.0, kind: str = "sage", heads: int = 4):
        super().__init__()
        if kind == "gat" and hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads} for model=gat (each head gets hidden / heads)")
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.convs = nn.ModuleList(_conv(kind, a, b, i == layers - 1, heads) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])))
        self.dropout = dropout
        # GCN's normalisation needs the degrees of source and target in one graph, so
        # PyG's GCNConv has no (sources, targets) form: it runs over every node of a batch.
        self.bipartite = kind != "gcn"

    def forward(self, x: torch.Tensor, edge_index, hops: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
        """Outputs of every node of ``x``; or, given ``hops`` = (nodes added per hop, seeds
        first; edges per hop) of a sampled batch laid out hop by hop, of its seeds only."""
        if hops is not None and self.bipartite:
            return self._forward_hops(x, edge_index, *hops)
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x if hops is None else x[: int(hops[0][0])]


    def _forward_hops(self, x: torch.Tensor, edge_index: torch.Tensor, nodes: Sequence[int], edges: Sequence[int]) -> torch.Tensor:
        # Layer i only needs outputs for the nodes within L-1-i hops of the seeds, and only
        # the edges into them (a prefix of the hop-ordered edge list), so each layer runs
        # SAGEConv on (sources, targets) with the targets a prefix of the sources. The
        # outermost hop holds most of a batch's nodes and gets no output at all. Written
        # here because PyG's trim_to_layer still runs the first layer over every node.
        L = len(self.convs)
        if len(nodes) != L + 1 or len(edges) != L:
            raise ValueError(f"a batch sampled with {len(edges)} fan-outs ({len(nodes)} node counts) cannot feed a model of {L} layers: give one fan-out per layer")
        upto_n, upto_e = np.cumsum(nodes).tolist(), np.cumsum(edges).tolist()
        if upto_n[-1] != x.shape[0] or upto_e[-1] != edge_index.shape[1]:
            raise ValueError(f"hop counts cover {upto_n[-1]} nodes and {upto_e[-1]} edges; the batch has {x.shape[0]} and {edge_index.shape[1]}")
        for i, conv in enumerate(self.convs):
            n_dst, n_e = upto_n[L - 1 - i], upto_e[L - 1 - i]
            x = conv((x, x[:n_dst]), edge_index[:, :n_e], size=(x.shape[0], n_dst))
            if i < L - 1:
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


class MLP(nn.Module):
    """The features-only baseline GraphSAGE has to beat."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float = 0.0):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.lins):
            x = lin(x)
            if i < len(self.lins) - 1:
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


def adjacency(graph: SharedGraph) -> torch.Tensor:
    """The in-neighbour CSR as a sparse adjacency (row v aggregates indices[indptr[v]:indptr[v+1]])."""
    n = graph.num_nodes
    ip = torch.from_numpy(np.asarray(graph.indptr, dtype=np.int64))
    ix = torch.from_numpy(np.asarray(graph.indices, dtype=np.int64))
    with warnings.catch_warnings():  # torch notes that sparse CSR is beta; the product used here is stable
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(ip, ix, torch.ones(len(ix)), size=(n, n))


@dataclass(frozen=True)
class GNNTrainerConfig:
    """The trainer's slice of the job config."""

    in_dim: int
    """Feature width."""
    num_classes: int
    """Output classes."""
    hidden: int = 128
    """Hidden width of every layer."""
    layers: int = 2
    """Message-passing layers (one per fan-out)."""
    dropout: float = 0.2
    """Dropout between layers while training."""
    lr: float = 3e-3
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Adam weight decay."""
    seed: int = 0
    """Seed of the initial weights and the dropout masks."""
    model: str = "sage"
    """The layer: one of :data:`MODELS`."""
    heads: int = 4
    """Attention heads of each hidden layer (model=gat)."""


class GNNTrainer(CheckpointParts):
    """Ray actor: the GNN + Adam on sampled batches; evaluation on the full graph. It writes
    its own checkpoint part (:mod:`raylane.checkpoint_parts`): the model never passes
    through the driver."""

    def __init__(self, config: GNNTrainerConfig, graph: SharedGraph):
        self.config = config
        self.graph = graph
        torch.manual_seed(config.seed)
        self.device = device()
        self.model = GNN(config.in_dim, config.hidden, config.num_classes, config.layers, config.dropout, config.model, config.heads).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self._adj = None
        self.batches = 0
        self.fed = ""  # digest of every batch trained on, in order (see _feed)

    def train(self, batch: dict) -> dict:
        """One optimizer step on one batch (as :func:`raylane.actors.gnn_sampler.make_batch`
        returns it); the loss and accuracy on its seeds."""
        t0 = time.perf_counter()
        self.model.train()
        dev = self.device
        x = torch.as_tensor(batch["x"]).to(dev, torch.float32)  # features may travel as float16
        ei = torch.as_tensor(batch["edge_index"]).to(dev, torch.int64)
        y = torch.as_tensor(batch["y"]).to(dev)
        bs = int(batch["batch_size"])
        missing = [k for k in ("num_sampled_nodes", "num_sampled_edges") if k not in batch]
        if missing:
            raise ValueError(f"batch {batch.get('key')} lacks {missing}: train on batches as make_batch returns them (hop by hop, with the per-hop counts)")
        out = self.model(x, ei, (batch["num_sampled_nodes"], batch["num_sampled_edges"]))
        loss = F.cross_entropy(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} on batch {batch.get('key')}: lower lr (now {self.config.lr}) or check the features for huge values")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.batches += 1
        self._feed(batch)
        return {
            "loss": float(loss.detach()),
            "correct": int((out.argmax(1) == y).sum()),
            "seeds": bs,
            "nodes": int(x.shape[0]),
            "edges": int(ei.shape[1]),
            "train_s": time.perf_counter() - t0,
        }

    def _feed(self, batch: dict) -> None:
        """Chain the batch into :attr:`fed`: its key and a checksum of its sampled nodes and
        edges. Two runs whose ``fed`` agree trained on the same batches in the same order,
        which is what a run through sampler losses promises; the checksums cost well under a
        millisecond a batch (the features follow from the nodes)."""
        sums = [zlib.crc32(np.ascontiguousarray(batch[k]).tobytes()) for k in ("n_id", "edge_index")]
        self.fed = hashlib.blake2b(f"{self.fed}|{tuple(batch.get('key', ()))}|{sums}".encode(), digest_size=8).hexdigest()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Accuracy on validation and test nodes with full neighbourhoods (exact inference),
        and the seconds it took."""
        t0 = time.perf_counter()
        self.model.eval()
        g = self.graph
        if self._adj is None:
            self._adj = adjacency(g).to(self.device)
        x = torch.from_numpy(np.asarray(g.x)).to(self.device, torch.float32)
        pred = self.model(x, self._adj).argmax(1).cpu().numpy()
        y = np.asarray(g.y)
        acc = lambda idx: float((pred[idx] == y[idx]).mean()) if len(idx) else float("nan")  # noqa: E731
        return {"val_acc": acc(g.val_idx), "test_acc": acc(g.test_idx), "eval_s": time.perf_counter() - t0}

    def state(self) -> dict:
        buf = io.BytesIO()
        # The optimizer state has int keys and tuples; torch.save of plain containers of
        # tensors reads back with weights_only=True, so it still cannot run code.
        torch.save(_to_cpu(self.opt.state_dict()), buf)
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": buf.getvalue(),
            "rng": torch.get_rng_state(),
            "batches": self.batches,
            "fed": self.fed,
        }

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict({k: torch.as_tensor(v).to(self.device) for k, v in state["model"].items()})
        self.opt.load_state_dict(torch.load(io.BytesIO(state["optimizer"]), weights_only=True, map_location=self.device))
        torch.set_rng_state(torch.as_tensor(state["rng"], dtype=torch.uint8))
        self.batches = int(state.get("batches", 0))  # checkpoints of older versions did not count
        self.fed = str(state.get("fed", ""))

    def export_state(self) -> dict:
        return self.state()

    def import_state(self, state: dict) -> None:
        self.load_state(state)

    def info(self) -> dict:
        return {"pid": os.getpid(), "device": str(self.device), "batches": self.batches, "fed": self.fed}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def train_mlp_baseline(graph: SharedGraph, *, hidden: int = 128, layers: int = 2, epochs: int = 100, lr: float = 1e-2, seed: int = 0) -> float:
    """Test accuracy of an MLP on the features alone, trained full-batch (the bar GraphSAGE must clear)."""
    torch.manual_seed(seed)
    x = torch.from_numpy(np.asarray(graph.x)).float()
    y = torch.from_numpy(np.asarray(graph.y))
    train = torch.from_numpy(np.concatenate(graph.train_seeds))
    model = MLP(x.shape[1], hidden, graph.num_classes, layers, dropout=0.2)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best_val, best_test = -1.0, 0.0
    val, test = torch.from_numpy(graph.val_idx), torch.from_numpy(graph.test_idx)
    for _ in range(epochs):
        model.train()
        loss = F.cross_entropy(model(x[train]), y[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            pred = model(x).argmax(1)
        v = float((pred[val] == y[val]).float().mean())
        if v > best_val:  # the baseline gets its best epoch by validation: a fair bar
            best_val, best_test = v, float((pred[test] == y[test]).float().mean())
    return best_test


@ray.remote(concurrency_groups=CHECKPOINT_GROUPS)
class GNNTrainerActor(GNNTrainer):
    """:class:`GNNTrainer` in a process of its own, whose allocator keeps freed memory
    (see :mod:`raylane.actors.allocator`): a training step allocates and frees dozens of
    MiB of activations and gradients, and kept pages spare it the page faults."""

    def __init__(self, config: GNNTrainerConfig, graph: SharedGraph):
        keep_freed_memory()
        super().__init__(config, graph)
