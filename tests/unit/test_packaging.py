"""Packaging: `platform/` never shadows the standard library, the CLI runs from the
repo root, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=100)


def test_stdlib_platform_is_not_shadowed_from_repo_root():
    out = run("-c", "import platform, sysconfig; platform.system(); print(platform.__file__); print(sysconfig.get_paths()['stdlib'])")
    assert out.returncode == 0, out.stderr
    module_file, stdlib = out.stdout.split()
    assert module_file.startswith(stdlib), module_file
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_python_dash_m_raylane_help_runs_from_repo_root():
    out = run("-m", "raylane", "--help")
    assert out.returncode == 0, out.stderr
    for command in ("cluster", "jobs", "run"):
        assert command in out.stdout


def test_ray_and_torch_import_beside_the_platform_folder():
    out = run("-c", "import torch, ray, raylane.driver, raylane.actors, raylane.jobs.linreg; print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", quickstart, flags=re.S)]


def test_readme_has_two_quickstart_commands_and_ci_runs_the_second_verbatim():
    commands = readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    assert commands[0].endswith("raylane run ppo") and "torch==2.13.0" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, "the README's test command must appear verbatim as a line of .ci/run"
