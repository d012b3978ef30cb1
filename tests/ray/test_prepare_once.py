"""A run reads its inputs once: ``raylane run`` (its config assembled, its inputs read by
the job's prepare, its workload built) makes the env of a PPO run once and describes a
federated run's table once in the driver's process, where each used to happen two or three
times (the config's validate, the workload's constructor, the API's second validate)."""

from __future__ import annotations

import pytest

from raylane import registry
from raylane.launch import run_job
from raylane.prepare import job_config

from fed_tables import write_clients  # tests/fed_tables.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

RUN = ["driver.max_steps=1", "driver.progress=false", "driver.tensorboard=false"]


def counting(monkeypatch, module, name: str) -> list:
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[:1])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_raylane_run_ppo_builds_its_env_once_in_the_driver(ray_local, tmp_path, monkeypatch):
    import gymnasium

    made = counting(monkeypatch, gymnasium, "make")  # the rollout workers and the learner make theirs in their own processes
    spec = registry.get("ppo")
    summary = run_job(spec, job_config(spec, overrides=[*RUN, "workers=1", f"driver.runs_dir={tmp_path}"], run_name="once"))
    assert summary["state"] == "finished" and summary["steps"] == 1, summary
    assert len(made) == 1, made


def test_raylane_run_federated_describes_its_table_once(ray_local, tmp_path, monkeypatch):
    from raylane.jobs import federated

    described = counting(monkeypatch, federated, "describe_table")
    folder = write_clients(tmp_path / "t", clients=6, fmt="parquet")
    spec = registry.get("federated")
    conf = job_config(spec, overrides=[*RUN, f"data.path={folder}", "data.label=digit", "data.client_column=site", "clients_per_round=3",
                                       "actors=1", f"driver.runs_dir={tmp_path}"], run_name="once")
    summary = run_job(spec, conf)
    assert summary["state"] == "finished" and summary["steps"] == 1, summary
    assert len(described) == 1, described


def test_the_readmes_stepping_example_runs_as_written(ray_local, tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(m.group(1) for m in re.finditer(r"```python\n(.*?)```", text, re.S) if "d.step()" in m.group(1))
    stepping = block[block.index("conf = job_config("):]  # the part after the run() of a file the reader has
    monkeypatch.chdir(tmp_path)  # its runs/ folder lands here
    scope: dict = {}
    exec("from raylane.api import Driver, job_config, workload\n" + stepping, scope)
    summary = scope["summary"]
    assert summary["state"] == "finished" and summary["steps"] == 5 and (tmp_path / "runs").is_dir(), summary
