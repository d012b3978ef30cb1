"""The job registry: every installed job, and the contract a job's config must meet."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from raylane.driver import DriverConfig
from raylane.registry import JobSpec, available

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_every_installed_job_declares_its_driver_config():
    jobs = available()
    assert set(jobs) >= {"graphsage", "linreg", "pipeline_lm", "ppo", "ps_ctr", "xgboost"}
    for spec in jobs.values():
        assert isinstance(spec.config_cls().driver, DriverConfig), spec.name


def test_a_config_without_a_driver_field_is_refused_saying_what_to_add():
    @dataclass
    class Mine:
        lr: float = 0.1

    with pytest.raises(TypeError, match=r"job 'mine': its config 'Mine' must be a dataclass with a field `driver: DriverConfig"):
        JobSpec("mine", "my job", Mine, lambda c: None)

    @dataclass
    class Good:
        lr: float = 0.1
        driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=5))

    assert JobSpec("mine", "my job", Good, lambda c: None).config_cls is Good


def test_a_users_job_by_file_or_module_and_each_way_it_can_be_wrong(tmp_path, monkeypatch):
    from raylane.registry import JobSpec, UnknownJobError, get

    (tmp_path / "myjobs").mkdir()
    (tmp_path / "myjobs" / "__init__.py").write_text("")
    body = ("from dataclasses import dataclass, field\nfrom raylane.api import DriverConfig, JobSpec\n"
            "@dataclass\nclass C:\n    driver: DriverConfig = field(default_factory=DriverConfig)\n"
            "JOB = JobSpec('mine', 'a job of my own', C, lambda c: None)\nOTHER = 3\n")
    (tmp_path / "myjobs" / "first.py").write_text(body)
    (tmp_path / "broken.py").write_text("import nosuchmodule_xyz\n")
    monkeypatch.chdir(tmp_path)
    assert isinstance(get("myjobs/first.py:JOB"), JobSpec) and get("myjobs/first.py:JOB").name == "mine"
    assert get("myjobs.first:JOB").name == "mine"  # as a module of the current folder
    bad = {
        "myjobs/nope.py:JOB": "no file 'myjobs/nope.py'",
        "myjobs/first.py:MISSING": "'myjobs/first.py' has no 'MISSING'; its JobSpecs: JOB",
        "myjobs/first.py:OTHER": "'OTHER' in 'myjobs/first.py' is of type int, not a JobSpec",
        "broken.py:JOB": "importing .*broken.py' failed: ModuleNotFoundError: No module named 'nosuchmodule_xyz'",
        "myjobs.absent:JOB": "importing module 'myjobs.absent' failed: ModuleNotFoundError",
        "myjobs/first.py:": "give a registered name, path/to/file.py:NAME or package.module:NAME",
    }
    for target, message in bad.items():
        with pytest.raises(UnknownJobError, match=message):
            get(target)


def test_run_keeps_what_the_config_says_unless_told_otherwise():
    from raylane.api import run_config

    from pathlib import Path

    spec = f"{Path(__file__).resolve().parents[2] / 'examples' / 'dp_classifier.py'}:JOB"
    assert run_config(spec, overrides=["driver.progress=true"]).driver.progress is True  # not overwritten by a default
    assert run_config(spec, overrides=["driver.progress=true"], progress=False).driver.progress is False
    assert run_config(spec, {"workers": 3}, run_name="mine").driver.run_name == "mine"
    with pytest.raises(ValueError, match="run_name"):
        run_config(spec, run_name="../out")
