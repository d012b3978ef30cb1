"""The command line refuses bad input before anything starts (no Ray is started here)."""

from __future__ import annotations

import pytest
import ray
from typer.testing import CliRunner

from raylane.cli import app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def _no_ray_from_earlier_modules():
    # A session-wide cluster fixture may leave this process connected; what is checked
    # here is that the command line itself starts nothing.
    if ray.is_initialized():
        ray.shutdown()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert not ray.is_initialized(), "bad input must be refused before Ray starts"
    return result


def test_jobs_lists_linreg_with_its_summary():
    result = invoke("jobs")
    assert result.exit_code == 0 and "linreg" in result.stdout and "Least squares" in result.stdout


def test_jobs_shows_a_jobs_config_keys_and_docs():
    result = invoke("jobs", "linreg")
    assert result.exit_code == 0
    assert "driver.max_steps" in result.stdout and "Gradient workers to" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "linreq"], "unknown job 'linreq'. Did you mean 'linreg'?"),
        (["run", "linreg", "--set", "workrs=2"], "unknown key 'workrs'"),
        (["run", "linreg", "--set", "workers=two"], "workers: expected int, got 'two' (str)"),
        (["run", "linreg", "--set", "workers=0"], "workers: must be >= 1, got 0"),
        (["run", "linreg", "--set", "workers=-3"], "workers: must be >= 1, got -3"),
        (["run", "linreg", "--set", "driver.max_steps=0"], "driver.max_steps: must be >= 1, got 0"),
        (["run", "linreg", "--set", "workers=9"], "workers (9) must not exceed max_workers (8)"),
        (["run", "linreg", "--set", "workers"], "key=value"),
        (["run", "linreg", "--config", "no/such/file.yaml"], "no/such/file.yaml"),
        (["run", "linreg", "--set", "driver.run_name=../../escaped_run"], "run_name '../../escaped_run' would write outside the runs folder"),
        (["run", "linreg", "--run-name", ".."], "--run-name '..' would write outside the runs folder"),
        (["run", "linreg", "--set", "driver.runs_dir=/proc/nope"], "driver.runs_dir='/proc/nope' cannot be used"),
        (["run", "linreg", "--set", "driver.checkpoint_uri=/proc/x"], "driver.checkpoint_uri='/proc/x' cannot be used"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_yaml_config_and_set_override_are_layered(tmp_path):
    from raylane import registry
    from raylane.prepare import job_config as load_job_config

    path = tmp_path / "linreg.yaml"
    path.write_text("workers: 3\nlr: 0.2\ndriver:\n  max_steps: 7\n")
    conf = load_job_config(registry.get("linreg"), config_file=str(path), overrides=["lr=0.3"], run_name="abc")
    assert (conf.workers, conf.lr, conf.driver.max_steps, conf.driver.run_name) == (3, 0.3, 7, "abc")
