"""Graphs for GNN training: where they come from, how they are checked, and the shared form
the samplers and the trainer read.

A graph enters as a :class:`torch_geometric.data.Data` (``x``, ``edge_index``, ``y`` and
boolean ``train_mask``/``val_mask``/``test_mask``), either generated (:func:`sbm_graph`) or
read from a folder of plain arrays (:func:`load_graph`: ``.npy`` files, one ``.npz`` or
Parquet, never pickle). :func:`validate_graph` refuses a malformed one before any actor
starts. :func:`to_shared` turns it into :class:`SharedGraph`: the topology as CSR arrays
(in-neighbours of every node, so row ``v`` lists the sources of the edges into ``v``, the
messages ``v`` aggregates), features, labels and the training seeds of every METIS part.
Its arrays go into the object store once and are read zero-copy by every actor on a node.
"""

from __future__ import annotations

import io
import math
import posixpath
from dataclasses import dataclass

import numpy as np
import torch

MASKS = ("train_mask", "val_mask", "test_mask")


class GraphError(ValueError):
    """A graph that cannot be trained on; the message names the bad field and what is valid."""


# ----------------------------------------------------------------------------- generation


def sbm_graph(
    num_nodes: int,
    *,
    num_classes: int = 8,
    avg_degree: float = 20.0,
    homophily: float = 0.8,
    feature_dim: int = 32,
    feature_signal: float = 0.35,
    train_fraction: float = 0.5,
    val_fraction: float = 0.25,
    seed: int = 0,
):
    """A stochastic-block-model graph where a node's neighbourhood tells its class.

    Every node belongs to one of ``num_classes`` equal blocks (its label). Undirected edges
    are drawn so that a fraction ``homophily`` of them join nodes of the same block, the
    rest nodes of different blocks, for an average degree of ``avg_degree``. Features are
    the block's mean direction scaled by ``feature_signal`` plus unit Gaussian noise: on
    its own a node's features identify its class only weakly (an MLP gets far from
    perfect), while the mean over its neighbours averages the noise away, which is the
    gap GraphSAGE must show. Duplicate edges and self-loops are removed; both directions
    of every edge are stored. Masks split the nodes at random.
    """
    if num_nodes < 2 * num_classes:
        raise GraphError(f"num_nodes={num_nodes}: need at least 2 nodes per class ({2 * num_classes} for {num_classes} classes)")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, num_nodes)
    members = [np.flatnonzero(y == c) for c in range(num_classes)]
    members = [m if len(m) else np.array([c % num_nodes]) for c, m in enumerate(members)]
    pairs = int(num_nodes * avg_degree / 2)
    src = rng.integers(0, num_nodes, pairs)
    same = rng.random(pairs) < homophily
    # Target class: the source's own with probability `homophily`, else a uniformly random other one.
    shift = rng.integers(1, num_classes, pairs) if num_classes > 1 else np.zeros(pairs, dtype=np.int64)
    tcls = np.where(same, y[src], (y[src] + shift) % num_classes)
    dst = np.empty(pairs, dtype=np.int64)
    for c in range(num_classes):  # one vectorised draw per class, not per edge
        sel = np.flatnonzero(tcls == c)
        dst[sel] = members[c][rng.integers(0, len(members[c]), len(sel))]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    u, v = np.concatenate([src, dst]), np.concatenate([dst, src])
    code = np.unique(u.astype(np.int64) * num_nodes + v)
    edge_index = np.stack([code // num_nodes, code % num_nodes])
    means = rng.normal(size=(num_classes, feature_dim))
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    x = (feature_signal * math.sqrt(feature_dim) * means[y] + rng.normal(size=(num_nodes, feature_dim))).astype(np.float32)
    order = rng.permutation(num_nodes)
    n_train, n_val = int(train_fraction * num_nodes), int(val_fraction * num_nodes)
    masks = {k: np.zeros(num_nodes, dtype=bool) for k in MASKS}
    masks["train_mask"][order[:n_train]] = True
    masks["val_mask"][order[n_train : n_train + n_val]] = True
    masks["test_mask"][order[n_train + n_val :]] = True
    return make_data(x, edge_index, y, **masks)


def make_data(x, edge_index, y, train_mask, val_mask, test_mask):
    """A PyG ``Data`` from arrays (numpy or torch), with the dtypes the rest expects."""
    from torch_geometric.data import Data

    def t(a, dtype):
        return torch.as_tensor(np.array(a)).to(dtype)  # a copy: loaded arrays may be read-only

    return Data(
        x=t(x, torch.float32), edge_index=t(edge_index, torch.int64), y=t(y, torch.int64),
        train_mask=t(train_mask, torch.bool), val_mask=t(val_mask, torch.bool), test_mask=t(test_mask, torch.bool),
    )


# ----------------------------------------------------------------------------- loading

_FILES = ("x", "edge_index", "y") + MASKS


def load_graph(uri: str):
    """Read a graph from ``uri`` (a local path or any pyarrow filesystem URI), without pickle.

    Accepted layouts:

    - a folder with ``x.npy``, ``edge_index.npy`` (shape [2, E]), ``y.npy`` and the three
      boolean mask files ``train_mask.npy``, ``val_mask.npy``, ``test_mask.npy``;
    - a single ``.npz`` file holding arrays with those names;
    - a folder with ``edges.parquet`` (integer columns ``src``, ``dst``) and
      ``nodes.parquet`` (one row per node in id order: ``y``, the three mask columns, and
      the features as columns ``x0``, ``x1``, ... or one fixed-size list column ``x``).
    """
    from pyarrow import fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), str(uri))
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise GraphError(f"graph source {uri!r} does not exist (give a folder of .npy files, an .npz file, or a folder with nodes.parquet and edges.parquet)")

    def read_npy(p):
        with filesystem.open_input_file(p) as f:
            return np.load(io.BytesIO(f.read()), allow_pickle=False)

    if info.type == pafs.FileType.File:
        if not path.endswith(".npz"):
            raise GraphError(f"graph source {uri!r} is a file but not an .npz archive")
        with filesystem.open_input_file(path) as f:
            with np.load(io.BytesIO(f.read()), allow_pickle=False) as z:
                missing = [k for k in _FILES if k not in z.files]
                if missing:
                    raise GraphError(f"{uri!r} lacks arrays {missing}; it has {sorted(z.files)}")
                return make_data(**{k: z[k] for k in _FILES})
    names = {posixpath.basename(i.path) for i in filesystem.get_file_info(pafs.FileSelector(path))}
    if {"nodes.parquet", "edges.parquet"} <= names:
        return _load_parquet(filesystem, path)
    missing = [f"{k}.npy" for k in _FILES if f"{k}.npy" not in names]
    if missing:
        raise GraphError(f"graph folder {uri!r} lacks {missing} (or give nodes.parquet + edges.parquet); it has {sorted(names)}")
    return make_data(**{k: read_npy(posixpath.join(path, f"{k}.npy")) for k in _FILES})


def _load_parquet(filesystem, path: str):
    import pyarrow.parquet as pq

    edges = pq.read_table(posixpath.join(path, "edges.parquet"), filesystem=filesystem)
    nodes = pq.read_table(posixpath.join(path, "nodes.parquet"), filesystem=filesystem)
    for col in ("src", "dst"):
        if col not in edges.column_names:
            raise GraphError(f"edges.parquet lacks column {col!r}; it has {edges.column_names}")
    for col in ("y",) + MASKS:
        if col not in nodes.column_names:
            raise GraphError(f"nodes.parquet lacks column {col!r}; it has {nodes.column_names}")
    if "x" in nodes.column_names:
        x = np.stack(nodes.column("x").to_numpy(zero_copy_only=False))
    else:
        cols = sorted((c for c in nodes.column_names if c[:1] == "x" and c[1:].isdigit()), key=lambda c: int(c[1:]))
        if not cols:
            raise GraphError("nodes.parquet has no features: give a list column 'x' or columns 'x0', 'x1', ...")
        x = np.stack([nodes.column(c).to_numpy() for c in cols], axis=1)
    ei = np.stack([edges.column("src").to_numpy(), edges.column("dst").to_numpy()])
    return make_data(x, ei, nodes.column("y").to_numpy(), *(nodes.column(m).to_numpy(zero_copy_only=False) for m in MASKS))


def save_graph(data, folder: str) -> None:
    """Write ``data`` as a folder of ``.npy`` files that :func:`load_graph` reads back."""
    import os

    os.makedirs(folder, exist_ok=True)
    for k in _FILES:
        np.save(os.path.join(folder, f"{k}.npy"), getattr(data, k).numpy())


# ----------------------------------------------------------------------------- validation


def validate_graph(data) -> None:
    """Raise :class:`GraphError` naming the first thing that makes ``data`` untrainable."""
    for k in _FILES:
        if getattr(data, k, None) is None:
            raise GraphError(f"graph has no {k!r}")
    n = int(data.y.shape[0])
    if n == 0:
        raise GraphError("graph has no nodes (y is empty)")
    if data.y.dim() != 1:
        raise GraphError(f"y must be one label per node, shape [{n}]; got {tuple(data.y.shape)}")
    if data.x.dim() != 2 or data.x.shape[0] != n:
        raise GraphError(f"x has shape {tuple(data.x.shape)}: need one feature row per node, [{n}, F] (y has {n} labels)")
    if not torch.isfinite(data.x).all():
        raise GraphError("x contains NaN or infinite values")
    ei = data.edge_index
    if ei.dim() != 2 or ei.shape[0] != 2:
        raise GraphError(f"edge_index must have shape [2, E]; got {tuple(ei.shape)}")
    if ei.numel():
        lo, hi = int(ei.min()), int(ei.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise GraphError(f"edge_index holds node id {bad}, outside 0..{n - 1} (the graph has {n} nodes)")
    if int(data.y.min()) < 0:
        raise GraphError(f"y holds label {int(data.y.min())}; labels must be 0..C-1")
    for k in MASKS:
        m = getattr(data, k)
        if m.dtype != torch.bool or m.shape != (n,):
            raise GraphError(f"{k} must be a boolean vector of length {n}; got {m.dtype} {tuple(m.shape)}")
    if not bool(data.train_mask.any()):
        raise GraphError("train_mask selects no node: there is nothing to train on")


# ----------------------------------------------------------------------------- shared form


@dataclass(frozen=True)
class SharedGraph:
    """What samplers and the trainer read, as plain arrays (put once into the object store).

    ``indptr``/``indices``: CSR of in-neighbours (the sources of the edges into node v are
    ``indices[indptr[v]:indptr[v+1]]``). ``x``/``y``: features and labels. ``part``: the
    METIS part of every node. ``train_seeds``: the training nodes of each part, sorted.
    ``val_idx``/``test_idx``: evaluation nodes.
    """

    indptr: np.ndarray
    indices: np.ndarray
    x: np.ndarray
    y: np.ndarray
    part: np.ndarray
    train_seeds: tuple
    val_idx: np.ndarray
    test_idx: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1

    @property
    def num_parts(self) -> int:
        return len(self.train_seeds)


def csr_in(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of in-neighbours: ``(indptr, indices)`` with the sources of v's in-edges in row v."""
    src, dst = np.asarray(edge_index[0], dtype=np.int64), np.asarray(edge_index[1], dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
    return indptr, src[order]


def partition(edge_index: np.ndarray, num_nodes: int, parts: int, *, seed: int = 0) -> np.ndarray:
    """One METIS part per node (pymetis on the symmetrised graph without self-loops)."""
    if parts < 1:
        raise GraphError(f"parts={parts}: need at least one part")
    if parts > num_nodes:
        raise GraphError(f"{parts} partitions for a graph of {num_nodes} nodes: use at most {num_nodes} samplers")
    if parts == 1:
        return np.zeros(num_nodes, dtype=np.int64)
    import pymetis

    src, dst = np.asarray(edge_index[0], dtype=np.int64), np.asarray(edge_index[1], dtype=np.int64)
    u, v = np.concatenate([src, dst]), np.concatenate([dst, src])
    keep = u != v
    code = np.unique(u[keep] * num_nodes + v[keep])
    indptr, indices = csr_in(np.stack([code % num_nodes, code // num_nodes]), num_nodes)
    opts = pymetis.Options(seed=seed)
    adjacency = pymetis.CSRAdjacency(adj_starts=indptr.astype(np.int32), adjacent=indices.astype(np.int32))
    _, membership = pymetis.part_graph(parts, adjacency, options=opts)
    part = np.asarray(membership, dtype=np.int64)
    # METIS may leave a part empty on tiny or disconnected graphs; give it nodes so every
    # part has work (take from the largest part, keeping the assignment deterministic).
    for p in range(parts):
        if not (part == p).any():
            big = np.bincount(part, minlength=parts).argmax()
            idx = np.flatnonzero(part == big)
            part[idx[: max(1, len(idx) // 2)]] = p
    return part


FEATURE_DTYPES = ("float32", "float16")


def feature_array(x: np.ndarray, dtype: str) -> np.ndarray:
    """The features stored as ``dtype``: float16 halves the shared array and every batch's
    features on the wire (the trainer still computes in float32); refused where a value
    would not fit (|x| > 65504 becomes inf)."""
    if dtype not in FEATURE_DTYPES:
        raise GraphError(f"feature_dtype={dtype!r}: must be one of {', '.join(FEATURE_DTYPES)}")
    if dtype == "float16" and x.size:
        big = float(max(x.max(), -x.min()))  # no temporary copy of the features
        if big > float(np.finfo(np.float16).max):
            raise GraphError(f"feature_dtype='float16' cannot hold a feature of magnitude {big:g} (largest 65504): use float32 or rescale the features")
    return np.ascontiguousarray(x, dtype=dtype)


def to_shared(data, parts: int, *, seed: int = 0, feature_dtype: str = "float32") -> SharedGraph:
    """Validate ``data``, partition it into ``parts`` METIS parts, and build the CSR form,
    with the features stored as ``feature_dtype`` (see :func:`feature_array`)."""
    validate_graph(data)
    x = feature_array(data.x.numpy(), feature_dtype)
    n = int(data.y.shape[0])
    ei = data.edge_index.numpy()
    part = partition(ei, n, parts, seed=seed)
    indptr, indices = csr_in(ei, n)
    train = data.train_mask.numpy()
    seeds = tuple(np.flatnonzero(train & (part == p)) for p in range(parts))
    return SharedGraph(
        indptr=indptr, indices=indices, x=x, y=data.y.numpy().astype(np.int64),
        part=part, train_seeds=seeds, val_idx=np.flatnonzero(data.val_mask.numpy()), test_idx=np.flatnonzero(data.test_mask.numpy()),
    )
