"""Which gymnasium env a job means: plugin modules, unknown ids, missing optional packages."""

from __future__ import annotations

import sys

import pytest

from raylane.jobs.gym_envs import EnvError, make, resolve, split_id

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_users_module_is_imported_first_and_the_workers_get_module_colon_id(plugin):
    assert resolve(f"{plugin}:RaylaneTest/Corridor-v0") == f"{plugin}:RaylaneTest/Corridor-v0"
    assert resolve("RaylaneTest/Corridor-v0", env_module=plugin) == f"{plugin}:RaylaneTest/Corridor-v0"
    env = make(resolve("RaylaneTest/Corridor-v0", env_module=plugin))
    obs, _ = env.reset(seed=0)
    assert obs.shape == (1,)
    env.close()


def test_a_module_that_registers_other_ids_lists_them(plugin):
    with pytest.raises(EnvError, match=r"registers no 'RaylaneTest/Hallway-v0'; it registers RaylaneTest/Corridor-v0"):
        resolve(f"{plugin}:RaylaneTest/Hallway-v0")
    # asked again, the module is imported already and registers nothing new: still listed
    with pytest.raises(EnvError, match=r"registers no 'RaylaneTest/Hallway-v0'; it registers RaylaneTest/Corridor-v0"):
        resolve(f"{plugin}:RaylaneTest/Hallway-v0")


def test_a_module_that_registers_nothing_says_how_to_register(tmp_path, monkeypatch):
    (tmp_path / "raylane_no_envs.py").write_text("import gymnasium\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(EnvError, match=r"module 'raylane_no_envs' was imported but registers no environment at all; "
                                           r"register yours .*gymnasium.register\(id='Maze-v0', entry_point=YourEnv\)"):
            resolve("raylane_no_envs:Maze-v0")
    finally:
        sys.modules.pop("raylane_no_envs", None)


def test_plugin_namespaces_name_the_package_to_install():
    with pytest.raises(EnvError, match=r"plugin package ale-py: `pip install ale-py`, then use env_id 'ale_py:ALE/Pong-v5'"):
        resolve("ALE/Pong-v5")


def test_a_module_that_is_not_installed_is_one_line_naming_it():
    with pytest.raises(EnvError, match=r"module 'no_such_plugin_pkg' cannot be imported") as info:
        resolve("no_such_plugin_pkg:Foo-v0")
    assert "\n" not in str(info.value)


def test_a_near_miss_is_suggested():
    with pytest.raises(EnvError, match=r"Did you mean 'CartPole-v1'"):
        resolve("CartPol-v1")


def test_a_missing_optional_dependency_is_one_line_with_the_install_command():
    pytest.importorskip("gymnasium")
    try:
        import Box2D  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("Box2D is installed here: LunarLander can be made")
    with pytest.raises(EnvError, match=r"'LunarLander-v3' needs a package that is not installed: Box2D is not installed") as info:
        make(resolve("LunarLander-v3"))
    assert "gymnasium[box2d]" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("bad, why", [("mod:", "no environment id after"), ])
def test_malformed_ids(bad, why):
    with pytest.raises(EnvError, match=why):
        split_id(bad)


def test_two_different_modules_are_refused():
    with pytest.raises(EnvError, match="give the module once"):
        split_id("a:Foo-v0", env_module="b")
