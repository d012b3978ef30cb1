"""PPO on the user's own parts in real actors: an environment registered by their module
(imported in every rollout worker), its kwargs, their wrapper and their network."""

from __future__ import annotations

import sys

import pytest

from raylane.checkpoint import CheckpointStore
from raylane.driver import Driver, DriverConfig
from raylane.jobs.ppo import PPOConfig, PPOWorkload
from raylane.runlog import read_jsonl
from harness import ray_in_folder  # tests/harness.py
from market_helpers import wait_all_free  # tests/market_helpers.py
from plugin_envs import PLUGIN  # tests/plugin_envs.py: a corridor env and its registration

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

MODULE = "raylane_user_envs"


@pytest.fixture(scope="module")
def ray_in_project(tmp_path_factory):
    """A user's project folder holding their env module, Ray started from it: Ray puts the
    driver's working folder on every worker's import path, as for `raylane run` there."""
    folder = tmp_path_factory.mktemp("project")
    (folder / f"{MODULE}.py").write_text(PLUGIN)
    try:
        with ray_in_folder(folder, num_cpus=3):
            yield folder
    finally:
        sys.modules.pop(MODULE, None)
        import gymnasium as gym

        gym.registry.pop("RaylaneTest/Corridor-v0", None)


def test_rollout_workers_step_an_env_that_only_the_users_module_registers(ray_in_project, tmp_path):
    # env_module=X is the same as env_id "X:Id" (tests/unit/test_gym_envs.py): the workers get "X:Id"
    conf = PPOConfig(env_id="RaylaneTest/Corridor-v0", env_module=MODULE, envs_per_worker=2, rollout_steps=16,
                     target_return=None, plot=False, total_env_steps=10_000)
    conf.validate()
    assert conf.make_id == f"{MODULE}:RaylaneTest/Corridor-v0"
    conf.driver = DriverConfig(run_name="corridor", runs_dir=str(tmp_path), max_steps=3, progress=False, tensorboard=False)
    summary = Driver(PPOWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["steps"] == 3, summary
    rows = read_jsonl(tmp_path / "corridor" / "metrics.jsonl")
    assert rows[-1]["env_steps"] == 3 * 2 * 2 * 16  # both workers stepped the user's env every iteration


def test_ppo_trains_the_users_network_on_their_wrapped_env_with_kwargs_stepped_in_subprocesses(ray_in_project, tmp_path):
    """Everything of the user's at once, in real actors: env kwargs, a wrapper and a network
    factory from their module, and the async backend (a subprocess per env copy inside
    each rollout worker). The checkpoint holds the user's layers."""
    conf = PPOConfig(env_id=f"{MODULE}:RaylaneTest/Corridor-v0", env_kwargs={"length": 3}, wrappers=[f"{MODULE}:plus_one"],
                     policy=f"{MODULE}:tiny_policy", vector="async", envs_per_worker=2, rollout_steps=16,
                     target_return=None, plot=False, total_env_steps=10_000)
    conf.validate()
    wait_all_free()  # the previous test's actors release their CPUs asynchronously
    conf.driver = DriverConfig(run_name="byo", runs_dir=str(tmp_path), max_steps=3, checkpoint_every_steps=1, progress=False, tensorboard=False)
    summary = Driver(PPOWorkload(conf), conf.driver).run()
    assert summary["state"] == "finished" and summary["steps"] == 3, summary
    rows = read_jsonl(tmp_path / "byo" / "metrics.jsonl")
    assert rows[-1]["env_steps"] == 3 * 2 * 2 * 16
    # plus_one: a reward of 1 per step and 2 at the end, so a return is the episode's length + 1 >= 3 + 1
    assert rows[-1]["episodes"] > 0 and rows[-1]["return_mean"] >= 4.0, rows[-1]
    step, state = CheckpointStore(str(tmp_path / "byo" / "checkpoints")).load_whole()
    assert step == 3 and {k.split(".")[0] for k in state["workload"]["learner"]["params"]} == {"body"}
