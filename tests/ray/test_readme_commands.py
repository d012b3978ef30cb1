"""Every ``raylane run`` command the README shows that needs nothing of the reader's own (no
``my_*`` module, no data file), run as written with the installed ``raylane`` command from
the folder that holds ``examples/``, with a two-step budget and a private runs folder added."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
# What the reader would have to bring: their own modules, files, packages, a running cluster.
NEEDS_THE_READERS_OWN = re.compile(r"my_|\.npz|\.npy|/\s|visits|clicks|folder\.file|--address|\.\.\.|tokens")
ALREADY_TESTED = {"raylane run ppo --set env_id=examples.gridworld:Gridworld-v0"}  # tests/ray/test_examples.py
# A small budget per job beside the two steps, so each finishes in seconds on two cores.
# (xgboost's steps are chunks of rounds: 20 rounds in chunks of 10 are its two steps.)
SMALL = {"xgboost": ["num_boost_round=20", "checkpoint_every=10"], "pipeline_lm": ["text_chars=20000"],
         "ppo": ["workers=1", "envs_per_worker=2", "rollout_steps=32", "plot=false"]}
STEPS = {"xgboost": []}  # xgboost refuses driver.max_steps (its rounds say it)


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    found = dict.fromkeys(m.group(1).strip() for m in re.finditer(r"`(raylane run [^`]+)`", text))
    return [c for c in found if not NEEDS_THE_READERS_OWN.search(c) and c not in ALREADY_TESTED]


def test_the_readme_shows_commands_to_run():
    assert len(readme_commands()) >= 3, readme_commands()  # the pattern above still finds the README's commands


@pytest.mark.parametrize("command", readme_commands())
def test_a_readme_command_runs_as_written(command, tmp_path):
    exe = shutil.which("raylane") or str(Path(sys.executable).parent / "raylane")
    words = shlex.split(command)
    job = words[2].rsplit(":", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    steps = STEPS.get(job, ["driver.max_steps=2"])
    extra = [a for s in SMALL.get(job, []) + steps + [f"driver.runs_dir={tmp_path}", "driver.tensorboard=false"] for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": "", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([exe, *words[1:], "--run-name", "readme", "--no-progress", *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-3000:])
    summary = json.loads((tmp_path / "readme" / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps"] == 2 and summary["final_metrics"], summary
