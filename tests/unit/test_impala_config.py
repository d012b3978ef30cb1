"""``impala``'s config: bad values refused before Ray starts, naming the value and the range."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.registry import available

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("override,words", [
    ("max_staleness=-1", ["max_staleness", "-1", ">= 0"]),
    ("rho_clip=0", ["rho_clip", "0", "> 0"]),
    ("c_clip=-0.5", ["c_clip", "-0.5", "> 0"]),
    ("fragment_length=0", ["fragment_length", "0", ">= 1"]),
    ("queue_depth=0", ["queue_depth", "0", ">= 1"]),
    ("workers=0", ["workers", "0", ">= 1"]),
    ("queue_depth=1", ["queue_depth (1)", "fragments_per_update (2)"]),
    ("loss=a2c", ["loss", "a2c", "vtrace", "appo"]),
    ("env_id=CartPol-v1", ["CartPol-v1", "CartPole-v1"]),
])
def test_bad_values_are_refused_naming_the_value_and_what_is_valid(override, words):
    with pytest.raises((cfg.ConfigError, ValueError)) as err:
        config("impala", override)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_the_job_is_registered_with_its_defaults_valid():
    spec = available()["impala"]
    c = cfg.load_config(spec.config_cls)
    c.validate()
    assert c.loss == "appo" and c.queue_depth >= c.fragments_per_update
    assert c.emulate_step_s == 0.0  # the emulated slow nodes are never on by default
