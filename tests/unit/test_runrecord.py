"""A run name reused with another config is refused before anything starts: no Ray."""

from __future__ import annotations

import json

import pytest
import ray
from typer.testing import CliRunner

from raylane import config as cfg
from raylane import runrecord
from raylane.cli import app
from raylane.jobs.linreg import LinRegConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_differences_name_every_changed_key_and_skip_presentation():
    a = cfg.to_dict(cfg.load_config(LinRegConfig, overrides=["lr=0.5", "driver.progress=true"]))
    b = cfg.to_dict(cfg.load_config(LinRegConfig, overrides=["lr=0.1", "driver.max_steps=7", "driver.progress=false", "driver.run_name=x"]))
    assert runrecord.differences(a, b) == [("driver.max_steps", 50, 7), ("lr", 0.5, 0.1)]
    assert runrecord.differences(a, a) == []


def test_a_changed_config_is_refused_naming_the_keys_and_the_ways_out(tmp_path):
    run_dir = tmp_path / "r"
    runrecord.write_record("linreg", cfg.load_config(LinRegConfig), run_dir)
    changed = cfg.load_config(LinRegConfig, overrides=["lr=0.1"])
    with pytest.raises(cfg.ConfigError, match=r"(?s)run 'r' started with another config.*lr: 0.5 \(run\) -> 0.1 \(now\).*--new.*--resume-with-changes"):
        runrecord.check_resume("linreg", changed, run_dir)
    assert runrecord.check_resume("linreg", changed, run_dir, accept_changes=True) == [("lr", 0.5, 0.1)]
    assert runrecord.check_resume("linreg", cfg.load_config(LinRegConfig), run_dir) == []
    with pytest.raises(cfg.ConfigError, match="is a 'linreg' run, not 'ppo'"):
        runrecord.check_resume("ppo", changed, run_dir)
    assert runrecord.check_resume("linreg", changed, tmp_path / "fresh") == []
    (run_dir / "config.json").write_text("{torn")
    with pytest.raises(cfg.ConfigError, match="config.json is unreadable"):
        runrecord.check_resume("linreg", changed, run_dir)


def test_the_command_line_refuses_before_ray_starts(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    runrecord.write_record("linreg", cfg.load_config(LinRegConfig, overrides=[f"driver.runs_dir={tmp_path}"]), tmp_path / "mine")
    result = CliRunner().invoke(app, ["run", "linreg", "--run-name", "mine", "--set", f"driver.runs_dir={tmp_path}", "--set", "workers=3"])
    assert result.exit_code == 2, result.output
    assert "workers: 2 (run) -> 3 (now)" in result.output and "--resume-with-changes" in " ".join(result.output.split())
    assert not ray.is_initialized()
    assert json.loads((tmp_path / "mine" / "config.json").read_text())["config"]["workers"] == 2  # the record is untouched
