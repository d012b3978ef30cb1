"""A user's graph as it arrives: edges made two-way (or kept, and counted), each array
checked on its own and named in its error, isolated nodes reported. No Ray."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch

from raylane import config as cfg
from raylane.actors.graph import GraphError, make_data, prepare_edges, sbm_graph, to_shared, validate_graph
from raylane.actors.graph_io import load_graph
from raylane.jobs.graphsage import GraphSAGEConfig, GraphSAGEWorkload, describe_input

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def pairs(ei: np.ndarray) -> list[tuple[int, int]]:
    return sorted(zip(ei[0].tolist(), ei[1].tolist()))


def arrays(n: int = 10, **change) -> dict:
    """A small valid graph (a path 0 - 1 - ... - n-1 listed one way), with ``change`` applied."""
    a = dict(x=np.zeros((n, 3)), edge_index=np.stack([np.arange(n - 1), np.arange(1, n)]), y=np.arange(n) % 2,
             train_mask=np.arange(n) < n // 2, val_mask=np.arange(n) >= n // 2, test_mask=np.zeros(n, bool))
    return {**a, **change}


# ----------------------------------------------------------------------------- edges


def test_one_way_edges_are_made_two_way_with_the_count_of_reverses_added():
    ei = np.array([[0, 1, 2, 3], [1, 2, 1, 0]])  # 0->1 and 1->2 one way; 2->1 is 1->2's reverse; 3->0 one way
    out, r = prepare_edges(ei, 4)
    assert pairs(out) == [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (3, 0)]
    assert (r.undirected, r.given, r.one_way, r.reverses_added, r.duplicates, r.self_loops, r.used) == (True, 4, 2, 2, 0, 0, 6)


def test_duplicates_and_self_loops_are_dropped_and_counted():
    ei = np.array([[0, 0, 0, 1, 2, 2, 3], [1, 1, 1, 0, 2, 2, 3]])  # 0->1 three times, its reverse once, three self-loops
    out, r = prepare_edges(ei, 4)
    assert pairs(out) == [(0, 1), (1, 0)]
    assert (r.duplicates, r.self_loops, r.one_way, r.reverses_added, r.used) == (2, 3, 0, 0, 2)


def test_undirected_false_keeps_the_edges_as_given_and_still_counts_them():
    ei = np.array([[0, 0, 0, 1, 2, 2, 3], [1, 1, 3, 0, 2, 2, 1]])
    out, r = prepare_edges(ei, 4, undirected=False)
    assert np.array_equal(out, ei)  # order, duplicates and self-loops as given
    assert (r.undirected, r.given, r.duplicates, r.self_loops, r.one_way, r.reverses_added, r.used) == (False, 7, 1, 2, 2, 0, 7)
    line = describe_input({**asdict(r), "isolated": 0, "isolated_train": 0, "no_in_edges": 0, "no_in_edges_train": 0, "train_and_val": 0, "train_and_test": 0})
    assert line == ["graph.undirected=false: 7 edges used as given (source -> target), 1 duplicate edges and 2 self-loops kept; "
                    "2 edges have no reverse, so nothing flows back along them"]


def test_an_undirected_graph_passes_through_untouched():
    d = sbm_graph(500, seed=4)
    ei = d.edge_index.numpy()
    out, r = prepare_edges(ei, 500)
    assert np.array_equal(out, ei)  # same order too: the sampling of the generated graph does not change
    assert (r.one_way, r.duplicates, r.self_loops, r.reverses_added, r.used) == (0, 0, 0, 0, ei.shape[1])
    assert describe_input(to_shared(d, 2).report) == [f"graph.undirected=true: {ei.shape[1]} edges, already two-way, without duplicates or self-loops"]


@pytest.mark.parametrize("seed", range(5))
def test_prepare_edges_agrees_with_sets_on_random_multigraphs(seed):
    rng = np.random.default_rng(seed)
    n, e = int(rng.integers(2, 30)), int(rng.integers(0, 120))
    ei = rng.integers(0, n, (2, e))
    given = list(zip(ei[0].tolist(), ei[1].tolist()))
    edges = {(u, v) for u, v in given if u != v}
    want = sorted(edges | {(v, u) for u, v in edges})
    out, r = prepare_edges(ei, n)
    assert pairs(out) == want
    assert r.self_loops == sum(u == v for u, v in given) and r.duplicates == e - r.self_loops - len(edges)
    assert r.one_way == r.reverses_added == sum((v, u) not in edges for u, v in edges) and r.used == len(want)


# ----------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(y=np.arange(9) % 2), r"^y has 9 labels, but x has 10 rows: need one per node$"),
        (dict(x=np.zeros((9, 3))), r"^x has shape \(9, 3\): need one feature row per node, \[10, F\] \(y has 10 labels\)$"),
        (dict(y=np.array([0, 1, 0.5, 1, 0, 1, 0, 1, 0, 1])), r"^y holds 0\.5 at node 2: need integer class ids 0\.\.C-1"),
        (dict(y=np.array(["cat"] * 10)), r"^y has dtype <U3: need integer class ids 0\.\.C-1 \(map names to ids first"),
        (dict(y=-np.ones(10, int)), r"^y holds label -1 at node 0"),
        (dict(train_mask=np.array([1, 0, 2, 0, 0, 0, 0, 0, 0, 0])), r"^train_mask holds 2 at node 2: a mask must be boolean, or integers that are all 0 or 1; .* pass train_mask != 0"),
        (dict(val_mask=np.full(10, 0.5)), r"^val_mask has dtype float64: a mask must be boolean \(or integers 0/1\); convert it first"),
        (dict(test_mask=np.zeros(11, bool)), r"^test_mask has 11 entries, but x has 10 rows: need one per node$"),
        (dict(edge_index=np.array([[0, 4], [1, 10]])), r"^edge_index holds node id 10, outside 0\.\.9 \(the graph has 10 nodes\): edge 1 is 4 -> 10$"),
        (dict(edge_index=np.array([[0.0, 1.5], [1.0, 2.0]])), r"^edge_index holds 1\.5 at position \[0, 1\]: need integer node ids"),
        (dict(edge_index=np.zeros((5, 2), int)), r"^edge_index must have shape \[2, E\] .*got \(5, 2\): it looks like \[E, 2\], pass edge_index\.T$"),
        (dict(x=np.zeros(10)), r"^x has shape \(10,\): need \[N, F\]"),
        (dict(x=np.where(np.eye(10, 3) > 0, np.inf, 0.0)), r"^x holds NaN or infinite values in 3 rows \(first: node 0\)$"),
    ],
)
def test_each_bad_array_is_named_in_its_own_error(change, message, tmp_path):
    with pytest.raises(GraphError, match=message):
        validate_graph(make_data(**arrays(**change)))
    np.savez(tmp_path / "g.npz", **arrays(**change))  # the same through the loader a user goes through
    with pytest.raises(GraphError, match=message):
        validate_graph(load_graph(str(tmp_path / "g.npz")))


def test_whole_number_floats_and_0_1_integer_masks_are_converted():
    d = make_data(**arrays(x=np.ones((10, 3), dtype=np.int32), y=(np.arange(10) % 2).astype(float), edge_index=np.array([[0.0], [1.0]]),
                           train_mask=(np.arange(10) < 5).astype(np.int8), val_mask=np.zeros(10, np.uint8)))
    validate_graph(d)
    assert (d.x.dtype, d.y.dtype, d.edge_index.dtype, d.train_mask.dtype, d.val_mask.dtype) == (torch.float32, torch.int64, torch.int64, torch.bool, torch.bool)
    assert d.y.tolist() == [0, 1] * 5 and d.train_mask.tolist() == [True] * 5 + [False] * 5


def test_make_data_copies_the_callers_arrays():
    a = arrays()
    d = make_data(**a)
    d.y[0] = 7
    d.train_mask[:] = False
    assert a["y"][0] == 0 and a["train_mask"][0]


# ----------------------------------------------------------------------------- nodes and the job


def test_isolated_nodes_and_mask_overlaps_are_reported_with_their_training_seeds():
    ei = np.array([[0, 1, 2, 3], [1, 2, 3, 3]])  # 3 -> 3 is a self-loop only; nodes 4..9 have no edges
    g = to_shared(make_data(**arrays(edge_index=ei, test_mask=np.arange(10) == 1)), 1)
    r = g.report
    assert (r["isolated"], r["isolated_train"], r["no_in_edges"], r["train_and_test"], r["train_and_val"]) == (6, 1, 6, 1, 0)
    lines = describe_input(r)
    assert lines[0] == ("graph.undirected=true: 4 edges given; added 3 reverse edges (edges listed one way), "
                        "dropped 0 duplicate edges and 1 self-loops: 6 edges used (each pair both ways)")
    assert lines[1:] == ["warning: 6 nodes have no edges (1 of them training seeds): the model sees only their own features",
                         "warning: 1 nodes are in both train_mask and test_mask: test accuracy is measured partly on training nodes"]
    directed = to_shared(make_data(**arrays(edge_index=ei)), 1, undirected=False).report
    assert (directed["isolated"], directed["no_in_edges"], directed["no_in_edges_train"]) == (6, 7, 2)  # node 0 has no in-edge
    assert "warning: 7 nodes have no in-edges (2 of them training seeds): no neighbour's features reach them" in describe_input(directed)


def test_the_job_makes_a_one_way_npz_two_way_and_says_so(tmp_path, capsys):
    d = sbm_graph(300, feature_dim=4, seed=1)
    ei = d.edge_index.numpy()
    one_way = ei[:, ei[0] < ei[1]]
    np.savez(tmp_path / "g.npz", x=d.x.numpy(), edge_index=one_way, y=d.y.numpy(),
             train_mask=d.train_mask.numpy(), val_mask=d.val_mask.numpy(), test_mask=d.test_mask.numpy())
    for undirected, used in (("true", ei.shape[1]), ("false", one_way.shape[1])):
        conf = cfg.load_config(GraphSAGEConfig, overrides=[f"graph.path={tmp_path / 'g.npz'}", f"graph.undirected={undirected}"])
        w = GraphSAGEWorkload(conf)
        assert w.graph.num_edges == used and w.graph.report["used"] == used
        err = capsys.readouterr().err
        assert f"raylane: graphsage: graph.undirected={undirected}: {one_way.shape[1]} edges" in err, err
    assert GraphSAGEWorkload(conf, graph=w.graph).graph is w.graph and capsys.readouterr().err == ""  # a given graph: nothing to say
