"""The arithmetic of federated rounds, without Ray: client partitions, who takes part in a
round, the proximal term, and the weighted average of the client models.

Every choice is a function of ``(seed, round, client)`` alone, so a round run again after
a recovery or a resume picks the same clients, the same stragglers and the same dropouts.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch


def partition(labels: np.ndarray, clients: int, alpha: float | None, seed: int, *, min_rows: int = 2, tries: int = 100) -> list[np.ndarray]:
    """Each client's row indices (sorted); every row in exactly one client.

    ``alpha`` None: IID (a seeded shuffle cut into near-equal parts). Otherwise label skew:
    each class's rows are split over the clients in proportions drawn from Dirichlet(alpha)
    (small alpha: most clients see few classes). A draw that leaves a client with fewer than
    ``min_rows`` rows is drawn again (the next draw of the same seeded stream), up to ``tries``."""
    if clients < 1:
        raise ValueError(f"clients must be at least 1, got {clients}")
    if clients * min_rows > len(labels):
        raise ValueError(f"{clients} clients of at least {min_rows} rows need {clients * min_rows} rows; the data has {len(labels)}")
    rng = np.random.default_rng([seed, 7])
    if alpha is None:
        return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), clients)]
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (small: strong label skew), got {alpha}")
    classes = np.unique(labels)
    for _ in range(tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha)))[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_rows:
            return out
    raise ValueError(f"alpha={alpha} leaves some of the {clients} clients with fewer than {min_rows} rows in {tries} draws; "
                     "raise alpha or use fewer clients")


def _unit(*key: int) -> float:
    """A number in [0, 1) from integers, the same everywhere."""
    return float(np.random.default_rng([*key]).random())


def sample_clients(seed: int, round_: int, clients: int, k: int) -> list[int]:
    """The ``k`` clients of a round, sorted."""
    return sorted(np.random.default_rng([seed, 11, round_]).choice(clients, size=k, replace=False).tolist())


def is_straggler(seed: int, client: int, fraction: float) -> bool:
    """Whether a client is one of the emulated slow ones (fixed for the run)."""
    return fraction > 0 and _unit(seed, 13, client) < fraction


def drops_out(seed: int, round_: int, client: int, p: float) -> bool:
    """Whether a sampled client vanishes in this round (emulated dropout)."""
    return p > 0 and _unit(seed, 17, round_, client) < p


def proximal_term(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``mu / 2 * ||w - w_global||^2`` over every parameter (its gradient is
    ``mu * (w - w_global)``)."""
    total = sum(((p - a.detach()) ** 2).sum() for p, a in zip(params, anchor))
    return 0.5 * mu * total  # type: ignore[return-value]


def aggregate(updates: Sequence[tuple[Mapping[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """The weighted average of client models, weights normalised (each client's number of
    rows: FedAvg's n_k / n). Summed in the order given, so the same updates give the same bits."""
    if not updates:
        raise ValueError("no client updates to aggregate")
    weights = np.array([w for _, w in updates], dtype=np.float64)
    if not (weights > 0).all():
        raise ValueError(f"client weights must be > 0, got {weights.tolist()}")
    weights = weights / weights.sum()
    out = {}
    for name in updates[0][0]:
        acc = np.zeros_like(np.asarray(updates[0][0][name], dtype=np.float64))
        for (model, _), w in zip(updates, weights):
            acc += w * np.asarray(model[name], dtype=np.float64)
        out[name] = acc.astype(np.asarray(updates[0][0][name]).dtype)
    return out
