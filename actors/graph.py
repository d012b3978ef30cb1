"""Graphs for GNN training: where they come from, how they are checked, and the shared form
the samplers and the trainer read.

A graph enters as a :class:`torch_geometric.data.Data` (see :data:`INPUT_FORMAT`), either
generated (:func:`sbm_graph`) or read from plain arrays (:func:`raylane.actors.graph_io.load_graph`:
``.npy`` files, one ``.npz`` or Parquet, never pickle). :func:`make_data` refuses a conversion that would
change a value (a fractional label, a mask holding 2) and :func:`validate_graph` every other
flaw, each naming the array at fault, before any actor starts. :func:`to_shared` makes the
edges two-way unless told otherwise (:func:`prepare_edges`) and turns the graph into
:class:`SharedGraph`: the topology as CSR arrays (in-neighbours of every node, so row ``v``
lists the sources of the edges into ``v``, the messages ``v`` aggregates), features, labels,
the training seeds of every METIS part, and a report of what was done to the input. Its
arrays go into the object store once and are read zero-copy by every actor on a node.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

MASKS = ("train_mask", "val_mask", "test_mask")
ARRAYS = ("x", "edge_index", "y") + MASKS  # every array a graph is given as
INPUT_FORMAT = (
    "x: [N, F] finite numbers, one feature row per node; edge_index: [2, E] integer node ids 0..N-1, "
    "row 0 the sources and row 1 the targets; y: [N] integer class ids 0..C-1; "
    "train_mask, val_mask, test_mask: [N] booleans (or 0/1 integers)"
)


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
    code = _unique(u.astype(np.int64) * num_nodes + v)
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
    """A PyG ``Data`` from arrays (numpy or torch) in the dtypes the rest expects, refusing a
    conversion that would change a value (see :func:`convert_arrays`)."""
    from torch_geometric.data import Data

    given = dict(x=x, edge_index=edge_index, y=y, train_mask=train_mask, val_mask=val_mask, test_mask=test_mask)
    arrays = convert_arrays(**given)
    # Copy what the conversion did not: the caller's arrays stay theirs (and loaded ones may be read-only).
    return Data(**{k: torch.from_numpy(a.copy() if np.may_share_memory(a, np.asarray(given[k])) else a) for k, a in arrays.items()})


def convert_arrays(**arrays) -> dict[str, np.ndarray]:
    """Each of the graph's arrays in its working dtype, checked on its own: ``x`` real numbers
    (made float32); ``y`` and ``edge_index`` integers, or floats that all hold whole numbers
    (converted); masks boolean, or integers that are all 0 or 1 (converted). Anything else is
    a :class:`GraphError` naming the array and its first bad value.

    >>> convert_arrays(y=np.array([0.0, 2.0]), train_mask=np.array([1, 0]))
    {'y': array([0, 2]), 'train_mask': array([ True, False])}
    """
    out = {}
    for name, a in arrays.items():
        a, bad = np.asarray(a), None
        kind, ids = a.dtype.kind, "class ids 0..C-1" if name == "y" else "node ids"
        if name == "x" and kind not in "fiub":
            raise GraphError(f"x has dtype {a.dtype}: need real-valued features, one row per node")
        if name in ("y", "edge_index"):
            if kind not in "fiub":
                hint = " (map names to ids first: names, y = np.unique(y, return_inverse=True))" if name == "y" else ""
                raise GraphError(f"{name} has dtype {a.dtype}: need integer {ids}{hint}")
            if kind == "f":
                bad, why = ~np.isfinite(a) | (a != np.round(a)), f"need integer {ids}; floats are accepted only when every value is a whole number"
        if name in MASKS:
            if kind not in "biu":
                raise GraphError(f"{name} has dtype {a.dtype}: a mask must be boolean (or integers 0/1); convert it first, e.g. {name} > 0.5")
            if kind != "b":
                bad, why = (a != 0) & (a != 1), f"a mask must be boolean, or integers that are all 0 or 1; to select the nodes where it is nonzero, pass {name} != 0"
        if bad is not None and bad.any():
            at = np.unravel_index(int(np.argmax(bad)), a.shape)
            where = f"node {at[0]}" if a.ndim == 1 else f"position {list(map(int, at))}"
            raise GraphError(f"{name} holds {a[at].item()!r} at {where}: {why}")
        out[name] = a.astype({"x": np.float32, "y": np.int64, "edge_index": np.int64}.get(name, bool), copy=False)
    return out


# ----------------------------------------------------------------------------- validation


def validate_graph(data) -> dict[str, np.ndarray]:
    """Raise :class:`GraphError` naming the first thing that makes ``data`` untrainable, and
    the array it is in; return the arrays as numpy in their working dtypes.

    The node count is the length most arrays agree on (``x``'s rows in a tie), so a short
    ``y`` is blamed on ``y``, not on ``x``.
    """
    for k in ARRAYS:
        if getattr(data, k, None) is None:
            raise GraphError(f"graph has no {k!r}. The arrays: {INPUT_FORMAT}")
    a = convert_arrays(**{k: getattr(data, k) for k in ARRAYS})
    x, ei, y = a["x"], a["edge_index"], a["y"]
    if x.ndim != 2:
        raise GraphError(f"x has shape {x.shape}: need [N, F], one feature row per node")
    for k in ("y",) + MASKS:
        if a[k].ndim != 1:
            raise GraphError(f"{k} has shape {a[k].shape}: need one {'label' if k == 'y' else 'boolean'} per node, [{x.shape[0]}]")
    lengths = {k: a[k].shape[0] for k in ("x", "y") + MASKS}
    votes = list(lengths.values())
    n = max(votes, key=lambda v: (votes.count(v), v == lengths["x"]))
    ref = f"x has {n} rows" if lengths["x"] == n else f"y has {n} labels" if lengths["y"] == n else f"the masks have {n} entries"
    for k, length in lengths.items():
        if length != n and k == "x":
            raise GraphError(f"x has shape {x.shape}: need one feature row per node, [{n}, F] ({ref})")
        if length != n:
            raise GraphError(f"{k} has {length} {'labels' if k == 'y' else 'entries'}, but {ref}: need one per node")
    if n == 0:
        raise GraphError("graph has no nodes (x, y and the masks are empty)")
    if not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
        raise GraphError(f"x holds NaN or infinite values in {len(bad)} rows (first: node {bad[0]})")
    if ei.ndim != 2 or ei.shape[0] != 2:
        hint = ": it looks like [E, 2], pass edge_index.T" if ei.ndim == 2 and ei.shape[1] == 2 else ""
        raise GraphError(f"edge_index must have shape [2, E] (row 0 sources, row 1 targets); got {ei.shape}{hint}")
    if ei.size:
        lo, hi = int(ei.min()), int(ei.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            col = int(np.argmax((ei == bad).any(axis=0)))
            raise GraphError(f"edge_index holds node id {bad}, outside 0..{n - 1} (the graph has {n} nodes): edge {col} is {ei[0, col]} -> {ei[1, col]}")
    if int(y.min()) < 0:
        raise GraphError(f"y holds label {int(y.min())} at node {int(np.argmin(y))}; labels must be 0..C-1")
    if not a["train_mask"].any():
        raise GraphError("train_mask selects no node: there is nothing to train on")
    return a


# ----------------------------------------------------------------------------- edges


@dataclass(frozen=True)
class EdgeReport:
    """What :func:`prepare_edges` found in the edges given and what it did about them."""

    undirected: bool
    given: int  # edges in the input
    self_loops: int  # edges u -> u
    duplicates: int  # repeats of a (source, target) pair, self-loops aside
    one_way: int  # distinct edges u -> v (u != v) given without v -> u
    reverses_added: int  # undirected: the reverses of the one-way edges; else 0
    used: int  # edges the samplers and the trainer see


def prepare_edges(edge_index: np.ndarray, num_nodes: int, *, undirected: bool = True) -> tuple[np.ndarray, EdgeReport]:
    """The edges to train on, with a report of what was found and done.

    ``undirected``: every edge both ways, each once, without self-loops: the pairs u < v in
    order, then their reverses (a graph that already is so is returned as given). Otherwise
    the edges are returned exactly as given, duplicates and self-loops included, and only
    counted. Vectorised: one sort of the E edges (a few tenths of a second for 4M).

    >>> ei, r = prepare_edges(np.array([[0, 1, 1, 2], [1, 2, 2, 2]]), 3)
    >>> ei.tolist(), (r.reverses_added, r.duplicates, r.self_loops, r.used)
    ([[0, 1, 1, 2], [1, 2, 0, 1]], (2, 1, 1, 4))
    """
    n = int(num_nodes)
    if n >= 2**31:
        raise GraphError(f"the graph has {n} nodes: at most 2^31 - 1 are supported")
    src, dst = np.asarray(edge_index[0], dtype=np.int64), np.asarray(edge_index[1], dtype=np.int64)
    loop = src == dst
    s, d = src[~loop], dst[~loop]
    # One sort answers every question: the key is the unordered pair, then the direction as its lowest bit.
    key = np.minimum(s, d) * n + np.maximum(s, d)
    key <<= 1
    key |= s > d
    key.sort()
    directed = _distinct(key)
    pairs = _distinct(directed >> 1)
    one_way = 2 * len(pairs) - len(directed)
    dups, loops = len(key) - len(directed), int(loop.sum())
    if undirected and (one_way or dups or loops):
        lo, hi = np.divmod(pairs, n)
        out = np.stack([np.concatenate([lo, hi]), np.concatenate([hi, lo])])
    else:
        out = np.stack([src, dst])
    return out, EdgeReport(undirected, len(src), loops, dups, one_way, one_way if undirected else 0, int(out.shape[1]))


def _distinct(sorted_keys: np.ndarray) -> np.ndarray:
    keep = np.empty(len(sorted_keys), dtype=bool)
    keep[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=keep[1:])
    return sorted_keys[keep]


def _unique(keys: np.ndarray) -> np.ndarray:
    """``np.unique`` of integer keys by one sort (np.unique took 4 s on 4M int64 keys with numpy 2.4, this 0.05 s)."""
    return _distinct(np.sort(keys))


def node_report(edge_index: np.ndarray, indptr: np.ndarray, masks: dict[str, np.ndarray]) -> dict[str, int]:
    """Nodes GraphSAGE can tell little about: ``isolated`` (no edge but self-loops) and
    ``no_in_edges`` (nothing flows into them; the same as isolated on an undirected graph),
    each with how many are training seeds; and nodes in two masks at once."""
    n = len(indptr) - 1
    keep = edge_index[0] != edge_index[1]
    touched = np.zeros(n, dtype=bool)
    touched[edge_index[0][keep]] = touched[edge_index[1][keep]] = True
    no_in, train = np.diff(indptr) == 0, masks["train_mask"]
    return {
        "isolated": int((~touched).sum()), "isolated_train": int((~touched & train).sum()),
        "no_in_edges": int(no_in.sum()), "no_in_edges_train": int((no_in & train).sum()),
        "train_and_val": int((train & masks["val_mask"]).sum()), "train_and_test": int((train & masks["test_mask"]).sum()),
    }


# ----------------------------------------------------------------------------- shared form


@dataclass(frozen=True)
class SharedGraph:
    """What samplers and the trainer read, as plain arrays (put once into the object store).

    ``indptr``/``indices``: CSR of in-neighbours (the sources of the edges into node v are
    ``indices[indptr[v]:indptr[v+1]]``). ``x``/``y``: features and labels. ``part``: the
    METIS part of every node. ``train_seeds``: the training nodes of each part, sorted.
    ``val_idx``/``test_idx``: evaluation nodes. ``report``: counts about the input.
    """

    indptr: np.ndarray
    indices: np.ndarray
    x: np.ndarray
    y: np.ndarray
    part: np.ndarray
    train_seeds: tuple
    val_idx: np.ndarray
    test_idx: np.ndarray
    report: dict = field(default_factory=dict)
    """What was found in the input and done to it (:class:`EdgeReport` and :func:`node_report`)."""

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
    src, dst = np.asarray(edge_index[0], dtype=np.int64), np.asarray(edge_index[1], dtype=np.int64)
    u, v = np.concatenate([src, dst]), np.concatenate([dst, src])
    keep = u != v
    code = _unique(u[keep] * num_nodes + v[keep])
    indptr, indices = csr_in(np.stack([code % num_nodes, code // num_nodes]), num_nodes)
    part = _metis(parts, indptr.astype(np.int32), indices.astype(np.int32), seed)
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


_METIS = """
import sys
import numpy as np
import pymetis
folder, parts, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
adjacency = pymetis.CSRAdjacency(adj_starts=np.load(folder + "/indptr.npy"), adjacent=np.load(folder + "/indices.npy"))
_, membership = pymetis.part_graph(parts, adjacency, options=pymetis.Options(seed=seed))
np.save(folder + "/part.npy", np.asarray(membership, dtype=np.int64))
"""


def _metis(parts: int, indptr: np.ndarray, indices: np.ndarray, seed: int, timeout_s: float = 3600.0) -> np.ndarray:
    """pymetis's partition of the CSR graph, computed in a fresh interpreter.

    Why a process of its own: in a process where Ray had run, METIS (as pymetis builds it)
    gave a different partition of the same graph now and then (two of five builds in one
    test process), so a resumed run, or the reference a test compares with, walked other
    batches. In a fresh interpreter the partition is a function of the graph and the seed
    alone; the start costs a fraction of a second."""
    with tempfile.TemporaryDirectory(prefix="raylane-metis-") as folder:
        np.save(f"{folder}/indptr.npy", indptr)
        np.save(f"{folder}/indices.npy", indices)
        try:
            subprocess.run([sys.executable, "-c", _METIS, folder, str(parts), str(seed)], check=True, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise GraphError(f"METIS did not partition the graph ({len(indptr) - 1} nodes, {len(indices)} edges) in {timeout_s:g} s") from None
        except subprocess.CalledProcessError as exc:
            raise GraphError(f"METIS failed on the graph ({len(indptr) - 1} nodes, {len(indices)} edges): {exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else exc}") from None
        return np.load(f"{folder}/part.npy")


def to_shared(data, parts: int, *, seed: int = 0, feature_dtype: str = "float32", undirected: bool = True) -> SharedGraph:
    """Validate ``data``, make its edges two-way unless ``undirected`` is false (see
    :func:`prepare_edges`), partition it into ``parts`` METIS parts, and build the CSR form,
    with the features stored as ``feature_dtype`` (see :func:`feature_array`)."""
    a = validate_graph(data)
    x = feature_array(a["x"], feature_dtype)
    n = int(a["y"].shape[0])
    ei, edges = prepare_edges(a["edge_index"], n, undirected=undirected)
    part = partition(ei, n, parts, seed=seed)
    indptr, indices = csr_in(ei, n)
    train = a["train_mask"]
    seeds = tuple(np.flatnonzero(train & (part == p)) for p in range(parts))
    return SharedGraph(
        indptr=indptr, indices=indices, x=x, y=a["y"].copy(), part=part, train_seeds=seeds,
        val_idx=np.flatnonzero(a["val_mask"]), test_idx=np.flatnonzero(a["test_mask"]),
        report={**asdict(edges), **node_report(ei, indptr, a)},
    )
