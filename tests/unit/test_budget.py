"""Budgets before work: a size off by orders of magnitude is refused, cleanly and at once,
before the job allocates anything; every default passes with room to spare."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from raylane import budget, prepare, registry
from raylane.budget import GiB, BudgetError, Estimate, Limit
from raylane.config import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


# ---------------------------------------------------------------- the pure helper


def test_check_passes_below_the_limit_and_returns_the_total():
    total = budget.check("demo", [Estimate("a", 1 * GiB, "a"), Estimate("b", 2 * GiB, "b")], limit=Limit(4 * GiB, "test"))
    assert total == 3 * GiB


def test_check_names_every_figure_the_limit_and_the_keys():
    with pytest.raises(BudgetError) as info:
        budget.check("demo", [Estimate("small: eval_rows (10) x 8 bytes", 80, "eval_rows"),
                              Estimate("big: rows (10) x features (3) x 8 bytes", 8 * GiB, ("rows", "features"), ("shards",))],
                     limit=Limit(4 * GiB, "the test's limit"))
    msg = str(info.value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)  # what the CLI prints as `error: ...`, exit 2
    assert msg.startswith("demo: the driver would need about 8.0 GiB, above its memory budget of 4.0 GiB (the test's limit)")
    assert "big: rows (10) x features (3) x 8 bytes = 8.0 GiB; small: eval_rows (10) x 8 bytes = 80 bytes" in msg  # largest first
    assert msg.endswith("Lower rows or features, or raise shards.")  # a figure under a tenth of the total sends nobody its way


def test_actor_estimates_say_per_actor(monkeypatch):
    monkeypatch.setenv(budget.ENV_VAR, str(GiB))
    with pytest.raises(BudgetError, match=r"each rollout worker \(per actor\) would need about 2.0 GiB, above the per-actor "
                                          r"memory budget of 1.0 GiB \(RAYLANE_MEMORY_BUDGET_BYTES=1073741824\)"):
        budget.check("demo", [Estimate("envs", 2 * GiB, "envs_per_worker")], where="rollout worker")


def test_the_limit_is_this_machines_available_memory_unless_overridden(monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    avail = psutil.virtual_memory().available
    limit = budget.driver_limit()
    assert abs(limit.nbytes - budget.SAFETY * avail) < 0.1 * avail and budget.ENV_VAR in limit.source
    assert budget.actor_limit().nbytes > 0
    monkeypatch.setenv(budget.ENV_VAR, "123_000")
    assert budget.driver_limit().nbytes == budget.actor_limit().nbytes == 123_000
    for bad in ("lots", "-5", "0"):
        monkeypatch.setenv(budget.ENV_VAR, bad)
        with pytest.raises(BudgetError, match=budget.ENV_VAR):
            budget.driver_limit()


def test_check_count_names_the_product_and_the_keys():
    budget.check_count("demo", "samples", 100, 100, "a (10) x b (10)", ["a", "b"], "why")
    with pytest.raises(BudgetError, match=r"^demo: a \(10\) x b \(11\) = 110 samples, above the bound of 100 \(why\). Lower a or b.$"):
        budget.check_count("demo", "samples", 110, 100, "a (10) x b (11)", ["a", "b"], "why")


# ---------------------------------------------------------------- each job, built the way the CLI builds it


@pytest.mark.parametrize("job, overrides, key", [
    ("graphsage", ["graph.nodes=1000000000"], "graph.nodes"),
    ("linreg", ["rows=10000000000"], "rows"),
    ("ppo", ["envs_per_worker=100000"], "envs_per_worker"),
])
def test_an_extra_zero_is_refused_at_once_without_allocating(job, overrides, key, monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    spec = registry.get(job)  # the job's module imported: its imports are not the job's allocation
    rss, start = psutil.Process().memory_info().rss, time.monotonic()
    with pytest.raises(ConfigError) as info:
        prepare.build(spec, prepare.job_config(spec, overrides=overrides))
    took, grew = time.monotonic() - start, psutil.Process().memory_info().rss - rss
    assert took < 3.0, f"refused after {took:.1f} s"
    assert grew < 200 * 2**20, f"RSS grew by {grew / 2**20:.0f} MiB before the refusal"
    msg = str(info.value)
    assert msg.startswith(f"{job}: ") and key in msg and "Lower" in msg, msg
    if job != "ppo":  # ppo's is the bound on samples per fragment, not memory
        assert "GiB" in msg and budget.ENV_VAR in msg, msg


def test_a_graph_file_is_budgeted_from_its_headers(tmp_path, monkeypatch):
    # A folder of .npy files claiming 3M nodes x 100 features: only the headers are read.
    n, f, e = 3_000_000, 100, 30_000_000
    for name, shape, dtype in (("x", (n, f), np.float32), ("edge_index", (2, e), np.int64), ("y", (n,), np.int64),
                               ("train_mask", (n,), bool), ("val_mask", (n,), bool), ("test_mask", (n,), bool)):
        np.lib.format.open_memmap(tmp_path / f"{name}.npy", mode="w+", dtype=dtype, shape=shape).flush()  # sparse: no disk used
    monkeypatch.setenv(budget.ENV_VAR, str(4 * GiB))
    spec = registry.get("graphsage")
    with pytest.raises(ConfigError, match=r"graphsage: the driver would need about .* GiB.*edges: 60,000,000 \(both ways\) x 200 bytes.*Lower graph.path's size\."):
        prepare.build(spec, prepare.job_config(spec, overrides=[f"graph.path={tmp_path}"]))


def test_every_registered_job_passes_its_budget_with_defaults_and_far_below_it(monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    seen: list[tuple[str, str, float]] = []
    real = budget.check

    def recorded(job, estimates, *, where="driver", limit=None):
        total = real(job, estimates, where=where, limit=limit)
        seen.append((job, where, total))
        return total

    monkeypatch.setattr(budget, "check", recorded)
    jobs = registry.available()
    for name, spec in jobs.items():
        prepare.build(spec, prepare.job_config(spec))
    assert {j for j, _, _ in seen} >= {"graphsage", "linreg", "ppo", "impala", "ps_ctr", "pipeline_lm", "federated", "xgboost"}
    # Far below: a default needs at most a few hundred MiB anywhere, whatever this machine has free.
    assert max(t for _, _, t in seen) < 0.5 * GiB, sorted(seen, key=lambda s: -s[2])[:3]
