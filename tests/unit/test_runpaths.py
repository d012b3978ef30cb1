"""Run names and run folders are checked before anything starts: no Ray."""

from __future__ import annotations

import os

import pytest

from raylane import config as cfg
from raylane.driver import Driver, DriverConfig
from raylane.jobs.linreg import LinRegConfig
from raylane.prepare import job_config as load_job_config
from raylane.registry import get
from raylane.runpaths import RunPathError, check_run_name, check_writable_dir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("name, why", [
    ("../../escaped_run", "outside the runs folder"),
    ("..", "outside the runs folder"),
    (".", "outside the runs folder"),
    ("a/b", "outside the runs folder"),
    ("a\\b", "outside the runs folder"),
    ("", "empty"),
    ("   ", "empty"),
    ("tab\there", "control character"),
    ("new\nline", "control character"),
    ("x" * 129, "129 characters"),
    (" padded", "space"),
])
def test_bad_run_names_are_refused_wherever_they_come_from(name, why):
    with pytest.raises(RunPathError, match=why):
        check_run_name(name)
    with pytest.raises(cfg.ConfigError, match=rf"driver: run_name .*{why}"):  # --set and YAML
        cfg.from_dict(LinRegConfig, {"driver": {"run_name": name}})
    with pytest.raises(cfg.ConfigError, match=rf"--run-name .*{why}"):  # the flag
        load_job_config(get("linreg"), run_name=name)


def test_set_override_of_a_run_name_that_escapes_is_refused():
    with pytest.raises(cfg.ConfigError, match=r"run_name '\.\./\.\./escaped_run' would write outside the runs folder"):
        cfg.load_config(LinRegConfig, overrides=["driver.run_name=../../escaped_run"])


def test_good_run_names_pass():
    for name in ("ppo", "ppo-lr3e-4_2024.05.01", "2024-05-01", "x" * 128, "ünïcode-run"):
        assert check_run_name(name) == name


def test_the_driver_checks_a_run_name_given_in_python(tmp_path):
    class W:
        name = "w"

    with pytest.raises(RunPathError, match="outside the runs folder"):
        Driver(W(), DriverConfig(run_name="..", runs_dir=str(tmp_path)))


def test_run_folders_that_cannot_be_written_are_refused_before_ray_starts(tmp_path):
    with pytest.raises(RunPathError, match=r"driver.runs_dir='/proc/nope' cannot be used"):
        DriverConfig(runs_dir="/proc/nope").check_paths()
    with pytest.raises(RunPathError, match=r"driver.checkpoint_uri='/proc/x' cannot be used"):
        DriverConfig(runs_dir=str(tmp_path), checkpoint_uri="/proc/x").check_paths()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunPathError, match="driver.runs_dir"):
        check_writable_dir(str(blocker / "runs"), "driver.runs_dir")
    DriverConfig(runs_dir=str(tmp_path / "new" / "runs"), checkpoint_uri=f"file://{tmp_path}/ck").check_paths()
    assert (tmp_path / "new" / "runs").is_dir() and (tmp_path / "ck").is_dir()
    assert os.listdir(tmp_path / "ck") == []  # the probe file is gone
    DriverConfig(runs_dir=str(tmp_path), checkpoint_uri="s3://bucket/prefix").check_paths()  # left to its filesystem
