"""Reading and writing graphs as plain arrays (``.npy`` files, one ``.npz``, or Parquet),
from a local path or any pyarrow filesystem URI, never with pickle. What is read is checked
and converted by :func:`raylane.actors.graph.make_data`."""

from __future__ import annotations

import posixpath

import numpy as np

from raylane.arrays import load_npy, load_npz

from raylane.actors.graph import ARRAYS, INPUT_FORMAT, MASKS, GraphError, make_data


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
            try:
                return load_npy(f.read(), repr(p))
            except ValueError as exc:
                raise GraphError(str(exc)) from None

    if info.type == pafs.FileType.File:
        if not path.endswith(".npz"):
            raise GraphError(f"graph source {uri!r} is a file but not an .npz archive")
        with filesystem.open_input_file(path) as f:
            try:
                z = load_npz(f.read(), repr(uri))
            except ValueError as exc:
                raise GraphError(str(exc)) from None
        missing = [k for k in ARRAYS if k not in z]
        if missing:
            raise GraphError(f"{uri!r} lacks arrays {missing}; it has {sorted(z)}. The arrays: {INPUT_FORMAT}")
        return make_data(**{k: z[k] for k in ARRAYS})
    names = {posixpath.basename(i.path) for i in filesystem.get_file_info(pafs.FileSelector(path))}
    if {"nodes.parquet", "edges.parquet"} <= names:
        return _load_parquet(filesystem, path)
    missing = [f"{k}.npy" for k in ARRAYS if f"{k}.npy" not in names]
    if missing:
        raise GraphError(f"graph folder {uri!r} lacks {missing} (or give nodes.parquet + edges.parquet); it has {sorted(names)}. The arrays: {INPUT_FORMAT}")
    return make_data(**{k: read_npy(posixpath.join(path, f"{k}.npy")) for k in ARRAYS})


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
    for k in ARRAYS:
        np.save(os.path.join(folder, f"{k}.npy"), getattr(data, k).numpy())
