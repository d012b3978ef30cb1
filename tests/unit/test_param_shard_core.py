"""Parameter shards without Ray: layout, row placement and initial values, the update
rules against torch's optimizers, the consistency modes, idempotent pushes, state round
trips, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from typer.testing import CliRunner

from raylane import config as cfg
from raylane.actors import ctr
from raylane.actors.param_shard import ShardConfig, ShardCore
from raylane.actors.ps_layout import check_ids, dense_slices, init_rows, row_shard
from raylane.actors.ps_optim import UpdateRule
from raylane.cli import app
from raylane.jobs.ps_ctr import PSCTRConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_dense_slices_cover_every_tensor_once_and_balance_the_shards():
    sizes = {"a": 10, "b": 3, "c": 1001}
    slices = dense_slices(sizes, 4)
    for name, n in sizes.items():
        got = [slices[k][name] for k in range(4)]
        assert got[0][0] == 0 and got[-1][1] == n and all(got[k][1] == got[k + 1][0] for k in range(3))
    held = [sum(b - a for a, b in s.values()) for s in slices]
    assert max(held) - min(held) <= len(sizes)
    with pytest.raises(ValueError, match="shards must be a whole number >= 1, got 0"):
        dense_slices(sizes, 0)


def test_rows_go_to_a_fixed_shard_and_start_from_id_alone():
    ids = np.arange(20_000, dtype=np.int64)
    owner = row_shard("field0", ids, 4)
    assert owner.min() == 0 and owner.max() == 3
    assert np.array_equal(owner, row_shard("field0", ids, 4))
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 0.22 * len(ids)  # spread evenly
    assert not np.array_equal(owner, row_shard("field1", ids, 4))  # tables spread differently
    a = init_rows(3, "field0", np.array([5, 9, 5]), 4, 0.1)
    b = init_rows(3, "field0", np.array([9]), 4, 0.1)
    assert np.array_equal(a[0], a[2]) and np.array_equal(a[1], b[0])  # the same row, whoever asks, whenever
    assert np.abs(a).max() < 0.1 and not np.array_equal(a[0], a[1])


def test_feature_ids_of_the_wrong_type_are_refused_naming_the_table():
    with pytest.raises(TypeError, match=r"table 'field2': feature ids must be integers, got dtype float64"):
        check_ids("field2", np.array([1.5, 2.0]))
    with pytest.raises(TypeError, match="got dtype <U"):
        check_ids("field2", np.array(["a", "b"]))
    assert check_ids("t", np.array([3, 4], dtype=np.int32)).dtype == np.int64


@pytest.mark.parametrize("wd", [0.0, 0.3])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_update_rules_match_torch(name, wd):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(50, generator=g)
    grads = [torch.randn(50, generator=g) for _ in range(5)]
    p = torch.nn.Parameter(p0.clone())
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[name]([p], lr=0.1, weight_decay=wd)
    mine = UpdateRule(name, 0.1, weight_decay=wd)
    value = p0.numpy().copy()
    state = {s: np.zeros(50, np.float32) for s in mine.slots()}
    for t, gr in enumerate(grads, start=1):
        p.grad = gr.clone()
        opt.step()
        mine.update(value, gr.numpy(), state, t)
    np.testing.assert_allclose(value, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def shard(mode: str, workers: int = 2, staleness: int = 0, optimizer: str = "sgd") -> ShardCore:
    core = ShardCore(ShardConfig(0, 1, workers, {"w": (0, 4)}, {"t": 2}, mode, staleness, optimizer, 0.5, 0.05, 0, 5.0))
    core.init_dense({"w": np.ones(4, np.float32)})
    return core


def push(core, w, clock, g):
    return core.push(w, clock, {"w": np.full(4, g, np.float32)}, {"t": (np.array([7]), np.full((1, 2), g, np.float32))})


def test_sync_applies_a_clock_once_every_worker_pushed_it_averaged():
    core = shard("sync")
    assert core.may_serve(0) and not core.may_serve(1)
    assert push(core, 0, 0, 1.0)
    assert np.allclose(core.dense["w"], 1.0)  # waiting for worker 1
    assert not push(core, 0, 0, 1.0)  # a retried push is ignored
    assert push(core, 1, 0, 3.0)
    assert np.allclose(core.dense["w"], 1.0 - 0.5 * 2.0)  # mean gradient 2.0
    assert core.may_serve(1) and core.duplicates == 1
    assert not push(core, 1, 0, 3.0)  # a clock already applied is ignored too


def test_sync_sums_a_clock_in_worker_order_whatever_order_the_pushes_arrive_in():
    grads = [np.float32(0.1), np.float32(1e8), np.float32(-1e8)]  # (a + b) + c != (a + c) + b in float32
    finals = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        core = shard("sync", workers=3)
        for w in order:
            push(core, w, 0, grads[w])
        finals.append((core.dense["w"].copy(), core.tables["t"].values[:1].copy()))
    assert all(np.array_equal(f[0], finals[0][0]) and np.array_equal(f[1], finals[0][1]) for f in finals)


def test_async_applies_on_arrival_once_per_worker_and_clock():
    core = shard("async")
    push(core, 0, 0, 1.0)
    push(core, 0, 0, 1.0)
    push(core, 1, 5, 1.0)
    assert np.allclose(core.dense["w"], 1.0 - 2 * 0.5)
    assert core.updates == 2 and core.duplicates == 1 and core.may_serve(100)


def test_ssp_serves_a_pull_only_within_the_staleness_of_the_slowest_worker():
    core = shard("ssp", staleness=2)
    for clock in range(3):
        push(core, 0, clock, 0.0)
    assert core.worker_clock(0) == 3 and core.slowest() == 0
    assert core.may_serve(2) and not core.may_serve(3)  # worker 0 at clock 3 is 3 ahead of worker 1
    push(core, 1, 0, 0.0)
    assert core.may_serve(3)


def test_state_round_trips_and_rows_are_created_on_first_touch():
    core = shard("async", optimizer="adam")
    dense, rows = core.pull(0, 0, {"t": np.array([7, 8])})
    assert rows["t"].shape == (2, 2) and len(core.tables["t"]) == 2
    push(core, 0, 0, 1.0)
    saved = core.export_state()
    twin = shard("async", optimizer="adam")
    twin.import_state(saved)
    assert np.array_equal(twin.read({"t": np.array([7, 8])}, create=False)[1]["t"], core.read({"t": np.array([7, 8])}, create=False)[1]["t"])
    assert not push(twin, 0, 0, 1.0)  # what was applied before the checkpoint stays applied
    assert twin.updates == core.updates == 1  # the count of applied updates is part of the state
    _, r = twin.read({"t": np.array([123])}, create=False)
    assert np.array_equal(r["t"][0], init_rows(0, "t", np.array([123]), 2, 0.05)[0]) and len(twin.tables["t"]) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["shards=0"], "shards: must be >= 1, got 0"),
        (["workers=0"], "workers: must be >= 1, got 0"),
        (["staleness=-1"], "staleness: must be >= 0, got -1"),
        (["embedding_dim=0"], "embedding_dim: must be >= 1, got 0"),
        (["mode=eventual"], "mode"),
        (["optimizer=lion"], "optimizer"),
    ],
)
def test_bad_configs_are_refused_naming_the_value(overrides, message):
    with pytest.raises(cfg.ConfigError, match=message):
        cfg.load_config(PSCTRConfig, overrides=overrides)


def test_shard_config_refuses_bad_values_directly():
    with pytest.raises(ValueError, match="staleness must be a whole number >= 0, got -1"):
        ShardConfig(0, 1, 1, {}, {}, "ssp", -1)
    with pytest.raises(ValueError, match="embedding dim must be a whole number >= 1, got 0"):
        ShardConfig(0, 1, 1, {}, {"t": 0})
    with pytest.raises(ValueError, match="mode 'bsp' is not one of sync, async, ssp"):
        ShardConfig(0, 1, 1, {}, {}, "bsp")


def test_generated_clicks_carry_a_learnable_signal():
    shape = ctr.CTRShape(fields=4, buckets=1000)
    ids, numeric, labels = ctr.rows(shape, 0, 100, 5000)
    ids2, _, labels2 = ctr.rows(shape, 0, 4096, 4200)
    assert np.array_equal(ids[3996:4096], ids2[:100]) and np.array_equal(labels[3996:4096], labels2[:100])  # any range, same rows
    assert ids.dtype == np.int64 and ids.max() < 1000 and 0.2 < labels.mean() < 0.8
    from sklearn.metrics import roc_auc_score

    oracle = sum(ctr.hidden_weight(shape, 0, f, ids[:, f, :]).mean(axis=1) for f in range(4)) + numeric.astype(np.float64) @ np.linspace(-1, 1, shape.dense_features)
    assert roc_auc_score(labels, oracle) > 0.75


def test_cli_refuses_bad_input_before_ray_starts_and_documents_every_key():
    result = CliRunner().invoke(app, ["run", "ps_ctr", "--set", "shards=0"])
    assert result.exit_code == 2 and "shards: must be >= 1, got 0" in result.output
    assert not ray.is_initialized()
    keys = cfg.describe(PSCTRConfig)
    assert {"shards", "workers", "mode", "staleness", "embedding_dim", "optimizer"} <= {k for k, *_ in keys}
    assert all(doc for *_, doc in keys)


def test_a_malformed_push_is_refused_before_anything_changes():
    core = shard("sync")
    before = core.export_state()
    bad = [
        ({}, {}, "has no gradient for dense 'w'"),
        ({"w": np.zeros(3, np.float32)}, {}, "dense 'w' gradient has 3 values, this shard holds 4"),
        ({"w": np.zeros(4, np.float32)}, {"t": (np.array([1, 2]), np.zeros((2, 3), np.float32))}, r"gradients are \(2, 3\), expected \(2, 2\)"),
        ({"w": np.zeros(4, np.float32)}, {"u": (np.array([1]), np.zeros((1, 2), np.float32))}, "no embedding table 'u'"),
    ]
    for dense, sparse, message in bad:
        with pytest.raises(ValueError, match=message):
            core.push(0, 0, dense, sparse)
    assert core.pending == {} and np.array_equal(core.export_state()["dense"]["w"], before["dense"]["w"])
    assert push(core, 0, 0, 1.0)  # the same clock pushed properly is still taken


def test_the_record_of_applied_clocks_stays_small():
    core = shard("async", workers=1)
    for clock in range(500):
        push(core, 0, clock, 0.0)
    assert core.done[0] == 500 and core.above[0] == set() and core.worker_clock(0) == 500
    assert not push(core, 0, 250, 0.0)  # still known as applied
    with pytest.raises(ValueError, match="65 workers: a shard serves at most 64"):
        ShardConfig(0, 1, 65)
    with pytest.raises(cfg.ConfigError, match="workers .65. must not exceed 64"):
        cfg.load_config(PSCTRConfig, overrides=["workers=65"])
