"""Search specs for ``raylane tune``: parsing, mapping onto a job's config, refusals."""

from __future__ import annotations

import pytest

from raylane.jobs.ppo import PPOConfig
from raylane.tune.space import SearchSpaceError, check_space, parse_search, parse_spec, space_from_mapping, trial_count

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("text,kind,args", [
    ("loguniform(1e-4, 1e-2)", "loguniform", (1e-4, 1e-2)),
    ("uniform(0.9,0.999)", "uniform", (0.9, 0.999)),
    ("randint(1, 4)", "randint", (1, 4)),
    ("choice([64, 128])", "choice", ((64, 128),)),
    ("grid(['tanh', 'relu'])", "grid", (("tanh", "relu"),)),
    ("choice([[32], [64, 64]])", "choice", (([32], [64, 64]),)),
])
def test_every_spec_parses(text, kind, args):
    spec = parse_spec(text, "k")
    assert (spec.kind, spec.args) == (kind, args)


@pytest.mark.parametrize("text,words", [
    ("0.01", ["not a spec", "--set"]),
    ("logunifrom(1e-4, 1e-2)", ["unknown spec", "loguniform"]),
    ("uniform(1)", ["two numbers"]),
    ("uniform(1, )", ["do not parse"]),
    ("uniform(2, 1)", ["low (2)", "high (1)"]),
    ("uniform(1, 1)", ["must be below"]),
    ("loguniform(0, 1)", ["0 < low"]),
    ("randint(1.5, 4)", ["whole numbers"]),
    ("choice([])", ["non-empty list"]),
    ("choice(__import__('os'))", ["do not parse"]),
    ("uniform(nan, 1)", ["do not parse"]),
    ("uniform(1, float('inf'))", ["do not parse"]),
])
def test_bad_specs_are_refused_naming_the_spec(text, words):
    with pytest.raises(SearchSpaceError) as err:
        parse_spec(text, "lr")
    assert "lr" in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_search_options_and_yaml_mappings_give_the_same_space():
    a = parse_search(["lr=loguniform(1e-4,1e-2)", "driver.checkpoint_every_steps=choice([5, 10])"])
    b = space_from_mapping({"lr": "loguniform(1e-4,1e-2)", "driver": {"checkpoint_every_steps": "choice([5, 10])"}})
    assert {k: (v.kind, v.args) for k, v in a.items()} == {k: (v.kind, v.args) for k, v in b.items()}
    with pytest.raises(SearchSpaceError, match="given twice"):
        parse_search(["lr=uniform(0.1, 0.2)", "lr=uniform(0.1, 0.3)"])
    with pytest.raises(SearchSpaceError, match="key=SPEC"):
        parse_search(["loguniform(1e-4,1e-2)"])


def test_a_space_maps_onto_the_jobs_config_types():
    check_space(PPOConfig, parse_search([
        "lr=loguniform(1e-4, 1e-2)", "workers=randint(1, 4)", "hidden=choice([[32], [64, 64]])",
        "activation=grid(['tanh', 'relu'])", "gamma=uniform(0.9, 0.999)", "driver.checkpoint_every_steps=choice([5, 10])",
    ]))


@pytest.mark.parametrize("item,words", [
    ("lrr=loguniform(1e-4,1e-2)", ["'lrr'", "did you mean 'lr'"]),
    ("workers=uniform(1, 4)", ["workers", "whole numbers", "randint"]),
    ("workers=randint(0, 4)", ["workers", "0", ">= 1"]),
    ("gamma=uniform(0.9, 1.5)", ["gamma", "1.5"]),
    ("activation=choice(['tanh', 'gelu'])", ["activation", "gelu"]),
    ("hidden=choice([64, 128])", ["hidden", "64"]),
])
def test_values_the_config_would_refuse_are_refused_before_any_trial(item, words):
    with pytest.raises(SearchSpaceError) as err:
        check_space(PPOConfig, parse_search([item]))
    for w in words:
        assert w in str(err.value), str(err.value)


def test_a_key_both_fixed_and_searched_and_an_empty_space_are_refused():
    with pytest.raises(SearchSpaceError, match="both fixed"):
        check_space(PPOConfig, parse_search(["lr=uniform(0.001, 0.01)"]), base={"lr": 0.003})
    with pytest.raises(SearchSpaceError, match="empty"):
        check_space(PPOConfig, {})


def test_tune_domains_and_trial_counts():
    pytest.importorskip("ray.tune")
    space = parse_search(["lr=loguniform(1e-4,1e-2)", "workers=randint(1, 2)", "activation=grid(['tanh', 'relu', 'elu'])"])
    assert trial_count(space, 4) == 12
    workers = space["workers"].to_tune()
    assert {workers.sample() for _ in range(200)} == {1, 2}  # both ends included
    lr = space["lr"].to_tune()
    assert all(1e-4 <= lr.sample() <= 1e-2 for _ in range(100))
    assert space["activation"].to_tune() == {"grid_search": ["tanh", "relu", "elu"]}
