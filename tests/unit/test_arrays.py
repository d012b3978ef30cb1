"""Users' .npy/.npz files: a header that lies, a truncated or corrupt file, a pickle; each a
clear error naming the file, before anything is allocated."""

from __future__ import annotations

import io

import numpy as np
import pytest

from raylane.actors.graph import GraphError
from raylane.actors.graph_io import load_graph
from raylane.arrays import load_npy, load_npz

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def lying_npy(claim: int = 10**12) -> bytes:
    """A real .npy of 4 float64s whose header claims ``claim`` elements (same header length)."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(4))
    raw = buf.getvalue()
    old, new = b"(4,)", f"({claim},)".encode()
    head_end = raw.index(b"\n") + 1
    header = raw[:head_end].replace(old, new).replace(b" " * (len(new) - len(old)) + b"\n", b"\n", 1)
    assert len(header) == head_end
    return header + raw[head_end:]


def test_a_header_claiming_a_trillion_elements_is_refused_without_allocating():
    with pytest.raises(ValueError, match=r"claims a float64 array of shape \(1000000000000,\).*truncated or corrupt"):
        load_npy(lying_npy(), "'x.npy'")


def test_corrupt_and_pickled_files_are_refused_naming_them():
    with pytest.raises(ValueError, match="'a.npy' is not a valid .npy file"):
        load_npy(b"not an array at all", "'a.npy'")
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="'o.npy' holds Python objects"):
        load_npy(buf.getvalue(), "'o.npy'")
    with pytest.raises(ValueError, match="'g.npz' is not a valid .npz archive"):
        load_npz(b"PK\x03\x04 a truncated archive", "'g.npz'")
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(3))
    assert load_npz(buf.getvalue(), "z")["a"].tolist() == [0, 1, 2]


def test_a_graph_from_a_corrupt_npz_or_a_lying_npy_is_a_graph_error(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(GraphError, match="is not a valid .npz archive"):
        load_graph(str(tmp_path / "bad.npz"))
    folder = tmp_path / "g"
    folder.mkdir()
    for name in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask"):
        np.save(folder / f"{name}.npy", np.zeros(4))
    (folder / "x.npy").write_bytes(lying_npy())
    with pytest.raises(GraphError, match="x.npy.*claims a float64 array of shape"):
        load_graph(str(folder))


def test_token_ids_in_a_lying_npy_are_refused_naming_data_path(tmp_path):
    from raylane.jobs.pipeline_inputs import TokenData, load_tokens

    (tmp_path / "t.npy").write_bytes(lying_npy())
    with pytest.raises(ValueError, match="data.path .*t.npy.* claims"):
        load_tokens(TokenData(path=str(tmp_path / "t.npy")), text_chars=100, seed=0)
