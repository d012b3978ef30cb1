"""Re-sharding a parameter server's checkpoint: the state shard ``i`` of ``N`` holds, cut
from the states ``M`` shards saved. Pure numpy, no Ray.

Dense tensors are flat ranges (:func:`raylane.actors.ps_layout.dense_slices`), so a new
shard's range is pieced together from the old ranges that overlap it, values and optimizer
slots alike; embedding rows go where :func:`raylane.actors.ps_layout.row_shard` sends
them for ``N`` shards, with their optimizer state and step counts. The updates are
element-wise (SGD, Adagrad, Adam per value), so the re-cut model trains on exactly as the
saved one would have: the same parameters, the same loss curve. The clock bookkeeping is
the same on every shard at a step boundary and is carried over as it is; old states that
disagree on it are refused.

The old states come one at a time (an iterator), so a shard reading them holds one old
state and its own new one, not the whole model.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from raylane.actors.ps_layout import dense_slices, row_shard

CLOCKS = ("done", "above", "next_clock", "updates", "dense_steps")


def reshard(old: Iterable[tuple[int, Mapping[str, Any]]], old_shards: int, index: int, shards: int, sizes: Mapping[str, int]) -> dict[str, Any]:
    """The state of shard ``index`` of ``shards``, from ``(old index, old state)`` pairs of a
    checkpoint of ``old_shards`` shards (each exactly once); ``sizes``: every dense tensor's
    number of values."""
    if not 0 <= index < shards:
        raise ValueError(f"shard index {index}: must be in 0..{shards - 1}")
    before, mine = dense_slices(sizes, old_shards), dense_slices(sizes, shards)[index]
    dense = {n: np.zeros(b - a, np.float32) for n, (a, b) in mine.items()}
    covered = {n: np.zeros(b - a, bool) for n, (a, b) in mine.items()}
    dense_state: dict[str, dict[str, np.ndarray]] = {}
    rows: dict[str, dict[str, list[np.ndarray]]] = {}
    clocks: dict[str, Any] | None = None
    seen: list[int] = []
    for j, state in old:
        if not 0 <= j < old_shards or j in seen:
            raise ValueError(f"old shard {j}: expected each of 0..{old_shards - 1} once (had {sorted(seen)})")
        seen.append(j)
        for name, (a, b) in before[j].items():
            if name not in mine:
                raise ValueError(f"dense tensor {name!r} of the checkpoint is not in this model ({sorted(mine)})")
            lo, hi = max(a, mine[name][0]), min(b, mine[name][1])
            if lo >= hi:
                continue
            at, take = slice(lo - mine[name][0], hi - mine[name][0]), slice(lo - a, hi - a)
            dense[name][at] = np.asarray(state["dense"][name], np.float32)[take]
            covered[name][at] = True
            for slot, values in state["dense_state"][name].items():
                dense_state.setdefault(name, {}).setdefault(slot, np.zeros(len(dense[name]), np.float32))[at] = np.asarray(values, np.float32)[take]
        for table, saved in state["tables"].items():
            ids = np.asarray(saved["ids"], np.int64)
            keep = row_shard(table, ids, shards) == index
            out = rows.setdefault(table, {})
            for key, values in saved.items():
                out.setdefault(key, []).append(np.asarray(values)[keep])
        these = {k: state[k] for k in CLOCKS}
        if clocks is None:
            clocks = these
        elif _plain(these) != _plain(clocks):
            raise ValueError(f"old shard {j} was saved at other clocks than shard {seen[0]} ({_plain(these)} against {_plain(clocks)}): "
                             "only a checkpoint taken at a step boundary re-shards; resume on the saved shard count")
    if sorted(seen) != list(range(old_shards)):
        raise ValueError(f"old shards {sorted(set(range(old_shards)) - set(seen))} are missing")
    if missing := [n for n, c in covered.items() if not c.all()]:
        raise ValueError(f"dense tensors {missing} are not covered by the old shards' ranges (sizes do not match the checkpoint)")
    assert clocks is not None
    slots = {s for per in dense_state.values() for s in per}
    return {
        "dense": dense,
        "dense_state": {n: {s: dense_state.get(n, {}).get(s, np.zeros(len(v), np.float32)) for s in slots} for n, v in dense.items()},
        "tables": {t: {k: np.concatenate(parts) for k, parts in cols.items()} for t, cols in rows.items()},
        **clocks,
    }


def _plain(clocks: Mapping[str, Any]) -> dict:
    """Clocks comparable across shards (sets and lists of ``above`` alike)."""
    return {**clocks, "above": {str(w): sorted(a) for w, a in dict(clocks["above"]).items()}, "done": {str(w): int(d) for w, d in dict(clocks["done"]).items()}}
