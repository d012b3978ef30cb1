"""Federated rounds without Ray: partitions, sampling, the proximal term, aggregation, bad
input, and FedProx against FedAvg under stragglers over several seeds (in one process)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from raylane import config as cfg
from raylane.actors.fed_client import ClientConfig, ClientCore, make_model
from raylane.actors.fed_data import FedSource, load_digits_split
from raylane.actors.fed_math import aggregate, drops_out, is_straggler, partition, proximal_term, sample_clients

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.mark.parametrize("alpha", [None, 1.0, 0.1])
def test_partitions_put_every_row_in_exactly_one_client_and_repeat_by_seed(alpha):
    labels = np.random.default_rng(0).integers(0, 10, 1500)
    parts = partition(labels, 20, alpha, seed=3)
    assert len(parts) == 20 and all(len(p) >= 2 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1500))
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(labels, 20, alpha, seed=3)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, partition(labels, 20, alpha, seed=4)))
    # the share of a client's rows in its two largest classes: ~0.2 without skew
    top2 = np.median([np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts])
    if alpha == 0.1:
        assert top2 >= 0.8, top2  # label skew: most of a client's rows are of one or two classes (measured 0.92)
    if alpha is None:
        assert top2 <= 0.4, top2  # measured 0.30


def test_a_partition_that_cannot_give_every_client_rows_is_refused():
    with pytest.raises(ValueError, match="30 clients of at least 2 rows need 60 rows; the data has 50"):
        partition(np.zeros(50, dtype=int), 30, None, 0)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partition(np.zeros(50, dtype=int), 3, 0.0, 0)
    with pytest.raises(ValueError, match=r"alpha=0.001 leaves some of the 40 clients with fewer than 2 rows"):
        partition(np.arange(100) % 2, 40, 0.001, 0)


def test_rounds_pick_their_clients_stragglers_and_dropouts_from_the_seed_alone():
    assert sample_clients(0, 7, 20, 5) == sample_clients(0, 7, 20, 5) and len(set(sample_clients(0, 7, 20, 5))) == 5
    assert sample_clients(0, 7, 20, 5) != sample_clients(0, 8, 20, 5)
    share = np.mean([is_straggler(1, k, 0.5) for k in range(2000)])
    assert 0.45 < share < 0.55 and not any(is_straggler(1, k, 0.0) for k in range(50))
    assert 0.05 < np.mean([drops_out(1, r, 3, 0.1) for r in range(2000)]) < 0.15


def test_the_proximal_terms_gradient_is_mu_times_the_distance_to_the_global_model():
    torch.manual_seed(0)
    w = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    g = [torch.randn(4, 3), torch.randn(3)]
    mu = 0.37
    grads = torch.autograd.grad(proximal_term(w, g, mu), w)
    for gw, a, b in zip(grads, w, g):
        torch.testing.assert_close(gw, mu * (a.detach() - b))
    expected = 0.5 * mu * sum(float(((a - b) ** 2).sum()) for a, b in zip(w, g))
    assert float(proximal_term(w, g, mu)) == pytest.approx(expected, rel=1e-6)


def test_aggregation_is_the_row_weighted_average():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32), "b": np.array([4.0], np.float32)}
    out = aggregate([(a, 30.0), (b, 10.0)])
    np.testing.assert_allclose(out["w"], [1.5, 3.0])
    np.testing.assert_allclose(out["b"], [1.0])
    assert out["w"].dtype == np.float32
    with pytest.raises(ValueError, match="no client updates"):
        aggregate([])
    with pytest.raises(ValueError, match=r"client weights must be > 0, got \[30.0, 0.0\]"):
        aggregate([(a, 30.0), (b, 0.0)])


@pytest.mark.parametrize("overrides, message", [
    (["clients=4", "clients_per_round=5"], r"clients_per_round \(5\) cannot exceed clients \(4\)"),
    (["mu=-0.1"], r"mu"),
    (["alpha=0"], r"alpha"),
    (["local_epochs=0"], r"local_epochs"),
    (["round_deadline_s=0"], r"round_deadline_s"),
    (["algorithm=fedavg", "mu=0.1"], r"mu=0.1 is FedProx's proximal weight; algorithm=fedavg has none"),
    (["clients=1000", "clients_per_round=5"], r"1000 clients of at least 2 rows need 2000 rows"),
    (["algorithm=fedsgd"], r"algorithm: 'fedsgd' is not one of 'fedavg', 'fedprox'"),
])
def test_bad_federated_configs_are_refused_before_ray_starts(overrides, message):
    with pytest.raises(cfg.ConfigError, match=message):
        config("federated", *overrides)


def _rounds(seed: int, algorithm: str, rounds: int = 30) -> float:
    """``rounds`` of 5 of 20 clients with label skew (alpha 0.1) and half the clients
    stragglers (a quarter of their steps), as the job runs them; test accuracy."""
    core = ClientCore(ClientConfig(FedSource(seed, 0.2, 20, 0.1)))
    _, _, tx, ty = load_digits_split(seed, 0.2)
    model = make_model(64, 64, 10, seed)
    w = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    for r in range(rounds):
        used = []
        for k in sample_clients(seed, r, 20, 5):
            planned = core.planned_steps(k, 2)
            budget = max(1, int(planned / 4)) if is_straggler(seed, k, 0.5) else None
            out = core.train(k, w, r, epochs=2, mu=0.01 if algorithm == "fedprox" else 0.0, deadline_at=time.time() + 60, budget=budget)
            if algorithm == "fedprox" or out["steps"] == out["planned"]:
                used.append((out["weights"], float(out["rows"])))
        if used:
            w = aggregate(used)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in w.items()})
    return float((model(torch.from_numpy(tx)).argmax(1).numpy() == ty).mean())


def test_fedprox_keeping_stragglers_partial_work_beats_fedavg_dropping_them_over_seeds():
    """Measured over seeds 0..4 (30 rounds): FedAvg 0.46 0.47 0.73 0.25 0.35, FedProx
    (mu 0.01) 0.70 0.71 0.70 0.38 0.65; one seed may favour FedAvg slightly, the mean gap
    is 0.17. Asserted on seeds 0..3 with half of that gap as the margin."""
    torch.set_num_threads(1)
    avg = np.mean([_rounds(s, "fedavg") for s in range(4)])
    prox = np.mean([_rounds(s, "fedprox") for s in range(4)])
    assert prox >= avg + 0.07, (prox, avg)
