"""`raylane jobs` and `raylane cluster` fit the terminal: no docs column a word a line, no cell
cut with an ellipsis (the cluster layout is fed a ClusterView: no Ray)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from raylane import cli, config as cfg, registry, tables
from raylane.cluster import ClusterView, NodeInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PPO_KEYS = [row[0] for row in cfg.describe(registry.get("ppo").config_cls)]


def jobs_output(monkeypatch, width: int, *args: str) -> list[str]:
    # the CLI's console reads COLUMNS once, at import: give it the width under test instead
    monkeypatch.setattr(cli.commands, "console", Console(width=width, force_terminal=False, color_system=None))
    result = CliRunner().invoke(cli.app, ["jobs", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def doc_blocks(lines: list[str]) -> dict[str, list[str]]:
    """The block layout's doc lines (indented) under each key's header line."""
    blocks: dict[str, list[str]] = {}
    for line in lines[2:]:  # title, blank line
        if line.startswith(" " * tables.INDENT):
            blocks[key].append(line.strip())
        else:
            key = line.split()[0]
            blocks[key] = []
    return blocks


def test_jobs_ppo_at_80_columns_is_one_block_per_key_with_docs_wrapped_by_words(monkeypatch):
    lines = jobs_output(monkeypatch, 80, "ppo")
    assert len(lines) < 3 * len(PPO_KEYS) + 4, "\n".join(lines)
    assert max(len(line) for line in lines) <= 80
    blocks = doc_blocks(lines)
    assert list(blocks) == PPO_KEYS
    for key, docs in blocks.items():
        assert docs, f"{key} lost its docs"
        # only a paragraph's last line may hold a single word
        assert all(len(line.split()) > 1 for line in docs[:-1]), (key, docs)
    assert "env_id  str = 'CartPole-v1'" in lines, "a default is shown in full, not cut"


def test_jobs_ppo_at_200_columns_and_with_wide_is_the_table(monkeypatch):
    for width, args in ((200, ()), (80, ("--wide",))):
        text = "\n".join(jobs_output(monkeypatch, width, "ppo", *args))
        assert "┃ key" in text and "what it is" in text
        assert all(f"│ {key} " in text for key in PPO_KEYS)
    lines = jobs_output(monkeypatch, 200, "ppo")
    assert len(lines) < 2 * len(PPO_KEYS), "at 200 columns most docs fit on their row"


def test_jobs_list_at_80_columns_cuts_nothing(monkeypatch):
    text = "\n".join(jobs_output(monkeypatch, 80))
    assert "…" not in text
    assert all(f"│ {name} " in text for name in registry.available())


def test_the_real_console_follows_COLUMNS():
    env = dict(os.environ, COLUMNS="80")
    env.pop("FORCE_COLOR", None)
    out = subprocess.run([sys.executable, "-m", "raylane", "jobs", "ppo"], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 3 * len(PPO_KEYS) + 4 and max(map(len, lines)) <= 80


def make_view() -> ClusterView:
    gib = 2**30
    return ClusterView((
        NodeInfo("a1b2c3d4e5f6" + "0" * 44, address="10.0.0.1", cpus=8, gpus=1, accelerator_type="H100",
                 memory=32 * gib, speed=1.0, speed_source="label", is_head=True, available={"CPU": 4.0}),
        NodeInfo("ffeeddccbbaa" + "1" * 44, address="10.0.12.134", cpus=64, market="spot", speed=1.234,
                 speed_source="measured", draining=True, memory=256 * gib),
        NodeInfo("0123456789ab" + "2" * 44, address="10.0.0.3", alive=False),
    ))


def render(renderable, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 100])
def test_cluster_when_narrow_is_a_block_per_node_with_nothing_cut(width):
    view = make_view()
    text = render(tables.cluster_view(view, width), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for n in view.nodes:
        assert n.node_id[:12] in text and n.address in text and n.market in text
    assert "a1b2c3d4e5f6 (head)  alive" in text and "ffeeddccbbaa  draining" in text
    assert "accelerator H100" in text and "speed 1.234 (measured)" in text and "memory 256.0 GiB" in text


def test_cluster_when_wide_is_the_table_as_before():
    text = render(tables.cluster_view(make_view(), 200), 200)
    assert "…" not in text
    assert "│ a1b2c3d4e5f6 (head) │ 10.0.0.1    │ on-demand │ 1 (label)        │ 8   │ 1   │ H100" in text
    assert "│ ffeeddccbbaa        │ 10.0.12.134 │ spot      │ 1.234 (measured) │ 64  │ 0   │ -" in text


def test_pack_keeps_fields_whole():
    assert tables.pack(["speed 1 (label)", "CPU 8 (4 free)", "GPU 0"], 32) == ["speed 1 (label)  CPU 8 (4 free)", "GPU 0"]
    assert tables.pack(["a very long field"], 5) == ["a very long field"]
