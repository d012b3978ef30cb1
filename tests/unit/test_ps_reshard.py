"""Re-sharding a parameter server's checkpoint (raylane.actors.ps_reshard), without Ray:
every dense value and every embedding row lands where N shards keep it, with its optimizer
state, and a round trip gives back what was saved."""

from __future__ import annotations

import numpy as np
import pytest

from raylane.actors.ps_layout import dense_slices, row_shard
from raylane.actors.ps_reshard import reshard

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SIZES = {"w1": 37, "b1": 5, "out": 3}
TABLES = {"emb_0": 4, "emb_1": 4}


def whole_model(seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    dense = {n: rng.normal(size=k).astype(np.float32) for n, k in SIZES.items()}
    rows = {}
    for t, dim in TABLES.items():
        ids = rng.choice(10_000, size=300, replace=False).astype(np.int64)
        rows[t] = {"ids": ids, "values": rng.normal(size=(len(ids), dim)).astype(np.float32), "steps": rng.integers(1, 9, len(ids)),
                   "state_acc": rng.random((len(ids), dim)).astype(np.float32)}
    return dense, rows


def cut(dense: dict, rows: dict, shards: int) -> list[dict]:
    """The states ``shards`` shards would hold of the whole model."""
    out = []
    for i, mine in enumerate(dense_slices(SIZES, shards)):
        tables = {}
        for t, r in rows.items():
            keep = row_shard(t, r["ids"], shards) == i
            tables[t] = {k: v[keep] for k, v in r.items()}
        out.append({"dense": {n: dense[n][a:b].copy() for n, (a, b) in mine.items()},
                    "dense_state": {n: {"acc": dense[n][a:b] * 2} for n, (a, b) in mine.items()},
                    "tables": tables, "done": {"0": 0, "1": 0}, "above": {"0": [], "1": []}, "next_clock": 40, "updates": 80, "dense_steps": 40})
    return out


def joined(states: list[dict]) -> tuple[dict, dict]:
    """The whole model back from shard states: dense in order, rows by id."""
    dense = {n: np.concatenate([s["dense"][n] for s in states]) for n in SIZES}
    rows = {}
    for t in TABLES:
        ids = np.concatenate([s["tables"][t]["ids"] for s in states])
        order = np.argsort(ids)
        rows[t] = {k: np.concatenate([s["tables"][t][k] for s in states])[order] for k in states[0]["tables"][t]}
    return dense, rows


@pytest.mark.parametrize("m, n", [(4, 2), (2, 3), (3, 1), (1, 4), (4, 4)])
def test_every_value_and_row_goes_where_n_shards_keep_it(m, n):
    dense, rows = whole_model()
    saved = cut(dense, rows, m)
    new = [reshard(enumerate(saved), m, i, n, SIZES) for i in range(n)]
    want = cut(dense, rows, n)
    for i in range(n):
        for name in SIZES:
            assert np.array_equal(new[i]["dense"][name], want[i]["dense"][name])
            assert np.array_equal(new[i]["dense_state"][name]["acc"], want[i]["dense_state"][name]["acc"])
        for t in TABLES:
            assert np.all(row_shard(t, new[i]["tables"][t]["ids"], n) == i)
        assert (new[i]["next_clock"], new[i]["updates"], new[i]["dense_steps"]) == (40, 80, 40)
    got_dense, got_rows = joined(new)
    _, want_rows = joined(saved)
    assert all(np.array_equal(got_dense[k], dense[k]) for k in SIZES)
    for t in TABLES:
        assert all(np.array_equal(got_rows[t][k], want_rows[t][k]) for k in want_rows[t])


def test_a_round_trip_gives_back_the_saved_shards():
    dense, rows = whole_model(1)
    saved = cut(dense, rows, 4)
    two = [reshard(enumerate(saved), 4, i, 2, SIZES) for i in range(2)]
    back = [reshard(enumerate(two), 2, i, 4, SIZES) for i in range(4)]
    for a, b in zip(back, saved):
        assert all(np.array_equal(a["dense"][k], b["dense"][k]) for k in SIZES)
        for t in TABLES:
            oa, ob = np.argsort(a["tables"][t]["ids"]), np.argsort(b["tables"][t]["ids"])
            assert all(np.array_equal(a["tables"][t][k][oa], b["tables"][t][k][ob]) for k in b["tables"][t])


def test_shards_saved_at_different_clocks_or_a_missing_shard_are_refused():
    dense, rows = whole_model()
    saved = cut(dense, rows, 3)
    saved[2]["next_clock"] = 41
    with pytest.raises(ValueError, match=r"old shard 2 was saved at other clocks than shard 0.*resume on the saved shard count"):
        reshard(enumerate(saved), 3, 0, 2, SIZES)
    saved = cut(dense, rows, 3)
    with pytest.raises(ValueError, match=r"old shards \[2\] are missing"):
        reshard(enumerate(saved[:2]), 3, 0, 2, SIZES)
    with pytest.raises(ValueError, match=r"shard index 2: must be in 0..1"):
        reshard(enumerate(saved), 3, 2, 2, SIZES)
