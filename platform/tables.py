"""What ``raylane jobs`` and ``raylane cluster`` print, fitted to the terminal's width.

Pure rendering: rows in, a rich renderable out, no Ray, so each layout is testable at any
width by printing it to a ``Console(width=...)``. A wide terminal gets a table; a narrow one
gets one block per row, because a table squeezed below its natural width either wraps its
text column to a word a line or cuts cells with an ellipsis.
"""

from __future__ import annotations

import textwrap
from typing import Any, Iterable, Sequence

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from raylane.cluster import ClusterView, NodeInfo

# Below this many columns `raylane jobs JOB` lists each key as a block: beside a key, a type
# and a default the docs column of a table would get fewer than ~50 columns.
CONFIG_TABLE_MIN_WIDTH = 120
INDENT = 4


def jobs_table(jobs: Iterable[tuple[str, str]]) -> Table:
    """``raylane jobs``: one row per job name and its summary; the summary column wraps."""
    table = Table(title="raylane jobs")
    table.add_column("job", no_wrap=True)  # a name users type: never cut
    table.add_column("what it does")
    for name, summary in jobs:
        table.add_row(name, Text(summary))
    return table


def config_keys(title: str, rows: Sequence[tuple[str, str, Any, str]], width: int, *, wide: bool = False) -> RenderableType:
    """``raylane jobs JOB``: rows of ``(key, type, default, doc)`` from :func:`raylane.config.describe`.

    A table from ``CONFIG_TABLE_MIN_WIDTH`` columns on (or with ``wide``), else a block per key::

        workers  int = 2
            Rollout worker actors.
    """
    if wide or width >= CONFIG_TABLE_MIN_WIDTH:
        return _config_table(title, rows)
    blocks: list[RenderableType] = [Text(title, style="bold"), Text("")]
    for key, tname, default, doc in rows:
        head = Text.assemble((key, "bold"), "  ", (tname, "cyan"), " = ", _default_text(default))
        blocks.append(head)
        if doc:
            # whole words to the width, the docstring's own line breaks dropped (they are where
            # its source wrapped); textwrap rather than rich, so no line is padded with spaces
            blocks.append(Text(textwrap.fill(" ".join(doc.split()), max(width, INDENT + 20), initial_indent=" " * INDENT,
                                             subsequent_indent=" " * INDENT, break_on_hyphens=False)))
    return Group(*blocks)


def _config_table(title: str, rows: Sequence[tuple[str, str, Any, str]]) -> Table:
    table = Table(title=title)
    table.add_column("key", no_wrap=True)  # keys are what users type: never cut
    table.add_column("type", max_width=12, overflow="ellipsis", no_wrap=True)
    table.add_column("default", max_width=12)
    table.add_column("what it is", ratio=1)
    for key, tname, default, doc in rows:
        table.add_row(key, tname, _default_text(default), Text(doc))
    return table


def _default_text(default: Any) -> Text:
    from raylane.config import MISSING

    return Text("required", style="red") if default is MISSING else Text(repr(default))


def cluster_view(view: ClusterView, console_width: int) -> RenderableType:
    """``raylane cluster``: the node table when it fits in ``console_width`` columns without
    cutting a cell, else two lines per node, the second wrapped between whole fields::

        a1b2c3d4e5f6 (head)  alive  10.0.0.1  on-demand
            speed 1 (label)  CPU 8 (4 free)  GPU 1  accelerator H100  memory 31.2 GiB
    """
    title = f"Ray cluster: {len(view.alive)} alive node(s)"
    table = _cluster_table(title, view)
    unbounded = Console(width=10_000)
    if Measurement.get(unbounded, unbounded.options, table).maximum <= console_width:
        return table
    lines: list[RenderableType] = [Text(title, style="bold"), Text("")]
    for n in view.nodes:
        lines.append(Text.assemble((_node_name(n), "bold"), "  ", _status(n), "  ", n.address, "  ", n.market))
        fields = [
            f"speed {n.speed:g} ({n.speed_source})",
            f"CPU {n.cpus:g} ({n.available.get('CPU', 0):g} free)",
            f"GPU {n.gpus:g}",
            f"accelerator {n.accelerator_type or '-'}",
            f"memory {n.memory / 2**30:.1f} GiB",
        ]
        for line in pack(fields, console_width - INDENT):
            lines.append(Text(" " * INDENT + line))
    return Group(*lines)


def _cluster_table(title: str, view: ClusterView) -> Table:
    table = Table(title=title)
    for col in ("node", "address", "market", "speed", "CPU", "GPU", "accelerator", "memory GiB", "free CPU", "status"):
        table.add_column(col)
    for n in view.nodes:
        table.add_row(
            _node_name(n),
            n.address,
            n.market,
            f"{n.speed:g} ({n.speed_source})",
            f"{n.cpus:g}",
            f"{n.gpus:g}",
            n.accelerator_type or "-",
            f"{n.memory / 2**30:.1f}",
            f"{n.available.get('CPU', 0):g}",
            _status(n),
        )
    return table


def _node_name(n: NodeInfo) -> str:
    return n.node_id[:12] + (" (head)" if n.is_head else "")


def _status(n: NodeInfo) -> str:
    return "dead" if not n.alive else ("draining" if n.draining else "alive")


def pack(fields: Sequence[str], width: int, sep: str = "  ") -> list[str]:
    """Fields joined by ``sep`` into lines of at most ``width`` characters, never splitting a
    field (one longer than ``width`` gets a line of its own).

    >>> pack(["speed 1 (label)", "CPU 8 (4 free)", "GPU 0"], 32)
    ['speed 1 (label)  CPU 8 (4 free)', 'GPU 0']
    """
    lines: list[str] = []
    for f in fields:
        if lines and len(lines[-1]) + len(sep) + len(f) <= width:
            lines[-1] += sep + f
        else:
            lines.append(f)
    return lines
