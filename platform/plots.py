"""A plot of a run's main metric, written beside ``summary.json`` when the run ends.

``plot_run(run_dir, "loss")`` reads ``<run_dir>/metrics.jsonl`` and writes ``<run_dir>/loss.png``:
the metric against driver steps on the left, against seconds since the first row on the right.
Rows without the metric, or with a value that is not a finite number (``RunLog`` stores NaN
as the string ``"nan"``), are skipped. A plot must never fail a run: odd data or a matplotlib
error logs a warning and returns None.

Drawing uses ``matplotlib.figure.Figure`` with the Agg canvas directly, never pyplot's global
figure list, so it needs no display and is safe from any thread.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

from raylane.runlog import read_jsonl

log = logging.getLogger(__name__)


def _number(value) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and infinities are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def plot_filename(metric: str) -> str:
    """A safe file name for a metric's plot: ``"eval/return"`` -> ``"eval_return.png"``."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", metric).strip("._")
    return f"{stem or 'metric'}.png"


def plot_run(run_dir: Path, metric: str, *, title: str | None = None) -> Path | None:
    """Write ``<run_dir>/<metric>.png`` (metric vs step, metric vs elapsed seconds); return its path.

    Returns None, writing nothing, when ``metrics.jsonl`` is missing or holds no row with a
    finite value of ``metric``, or when anything goes wrong (logged as a warning)."""
    run_dir = Path(run_dir)
    try:
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r, dict)]
        times = [t for t in (_number(r.get("time")) for r in rows) if t is not None]
        t0 = times[0] if times else None
        by_step, by_time = [], []
        for r in rows:
            y = _number(r.get(metric))
            if y is None:
                continue
            step, t = _number(r.get("step")), _number(r.get("time"))
            if step is not None:
                by_step.append((step, y))
            if t is not None and t0 is not None:
                by_time.append((t - t0, y))
        if not by_step and not by_time:
            return None
        path = run_dir / plot_filename(metric)
        _draw(path, metric, title or f"{run_dir.name}: {metric}", by_step, by_time)
        return path
    except Exception as e:  # noqa: BLE001 - a plot must not fail a run
        log.warning("could not plot %r for %s: %s: %s", metric, run_dir, type(e).__name__, e)
        return None


def _draw(path: Path, metric: str, title: str, by_step: list, by_time: list) -> None:
    """Two panels side by side, saved through a temporary file so a crash leaves no torn PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric, title = metric.replace("$", r"\$"), title.replace("$", r"\$")  # literal text, not mathtext
    fig = Figure(figsize=(11, 4), dpi=100)
    FigureCanvasAgg(fig)
    panels = fig.subplots(1, 2)
    for ax, points, xlabel in ((panels[0], by_step, "step"), (panels[1], by_time, "elapsed seconds")):
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(points) < 50 else None)
        else:
            ax.text(0.5, 0.5, f"no {xlabel} recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        fig.clear()
