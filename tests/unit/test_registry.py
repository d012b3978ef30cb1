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
