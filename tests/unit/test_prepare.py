"""raylane.prepare: the one way a run is prepared (no Ray): the settings a job derives are
applied, said on the terminal and logged, and a config's values are checked before its inputs."""

from __future__ import annotations

import pytest

from raylane import prepare, registry
from raylane.config import ConfigError
from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SMALL = ["data.source=synthetic:classification", "data.rows=400", "data.num_features=4", "num_boost_round=30", "checkpoint_every=10"]


def test_derived_driver_settings_are_applied_said_and_logged(tmp_path, capfd):
    spec = registry.get("xgboost")
    conf = prepare.job_config(spec, overrides=[*SMALL, f"driver.runs_dir={tmp_path}"], run_name="derived")
    assert (conf.driver.max_steps, conf.driver.checkpoint_every_steps) == (3, 1)
    prepare.begin(spec, conf, tmp_path / "derived", [])
    said = capfd.readouterr().err
    assert "xgboost: driver.max_steps = 3 (num_boost_round=30: one step is a chunk of checkpoint_every=10 rounds)" in said, said
    event = next(e for e in read_jsonl(tmp_path / "derived" / "events.jsonl") if e["event"] == "derived_settings")
    assert event["settings"][0].startswith("driver.max_steps = 3 ") and event["settings"][1].startswith("driver.checkpoint_every_steps = 1 ")


def test_a_derived_setting_given_another_value_is_refused_not_overwritten():
    spec = registry.get("xgboost")
    with pytest.raises(ConfigError, match=r"driver.max_steps=7 does not apply to xgboost: it is 3 here"):
        prepare.job_config(spec, overrides=[*SMALL, "driver.max_steps=7"])


def test_a_job_without_derived_settings_or_inputs_prepares_to_nothing():
    spec = registry.get("linreg")
    conf = prepare.job_config(spec, overrides=["rows=64", "shards=4"])
    assert prepare.derive(conf) == [] and prepare.read_inputs(spec, conf) is None
