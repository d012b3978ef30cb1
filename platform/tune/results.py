"""What a search leaves: a row per trial, read from the trials' own run folders.

Each trial is a raylane run with its ``events.jsonl`` (its sampled values, every restart
by Tune and every exploit under PBT, every failure it recovered from), ``metrics.jsonl``
(one row per step) and ``summary.json``, so the table needs nothing but the search
folder. :func:`write` puts ``trials.csv``, ``trials.json`` and a plot of the metric
against time per trial beside them, and returns the best trial's ``raylane run`` line.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from raylane.runlog import read_jsonl

log = logging.getLogger(__name__)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def trial_row(run_dir: Path, metric: str, mode: str, state: str | None = None) -> dict[str, Any]:
    """One trial's row from its run folder. ``state`` (Tune's verdict, e.g. ``error``) wins over the summary's."""
    events = read_jsonl(run_dir / "events.jsonl")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if _num(r.get(metric)) is not None]
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    values = next((e.get("values", {}) for e in reversed(events) if e.get("event") == "tune_trial"), {})
    values = {k: values[k] for k in sorted(values)}
    best = (max if mode == "max" else min)((float(r[metric]) for r in rows), default=None)
    restores = [e for e in events if e.get("event") in ("tune_restore", "tune_exploit")]
    return {
        "trial": run_dir.name,
        **{f"config/{k}": v for k, v in values.items()},
        f"best_{metric}": best,
        f"last_{metric}": float(rows[-1][metric]) if rows else None,
        "steps": int(summary.get("steps") or (rows[-1]["step"] if rows else 0)),
        "state": state or summary.get("state", "unknown"),
        "restarts": sum(1 for e in restores if e["event"] == "tune_restore"),
        "exploits": sum(1 for e in restores if e["event"] == "tune_exploit"),
        "resumed_from": [int(e["step"]) for e in restores],
        "failures_recovered": sum(1 for e in events if e.get("event") == "failure" and e.get("decision") != "fail"),
        "wall_s": round(rows[-1]["time"] - rows[0]["time"], 3) if len(rows) > 1 else 0.0,
        "run_dir": str(run_dir),
    }


def rows(trials_dir: Path, metric: str, mode: str, states: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Every trial's row, best first (trials without a value of the metric last; none when
    no trial got as far as making its folder)."""
    states = states or {}
    found = sorted(Path(trials_dir).iterdir()) if Path(trials_dir).is_dir() else []
    out = [trial_row(d, metric, mode, states.get(d.name)) for d in found if d.is_dir()]
    key = f"best_{metric}"
    sign = -1.0 if mode == "max" else 1.0
    return sorted(out, key=lambda r: (r[key] is None, sign * (r[key] or 0.0), r["trial"]))


def failed_row(trial: str, error: str, metric: str) -> dict[str, Any]:
    """The row of a trial that failed before it had a run folder: its error, no values."""
    return {"trial": trial, f"best_{metric}": None, f"last_{metric}": None, "steps": 0, "state": "error", "restarts": 0, "exploits": 0,
            "resumed_from": [], "failures_recovered": 0, "wall_s": 0.0, "run_dir": None, "error": error}


def best(table: Sequence[Mapping[str, Any]], metric: str) -> Mapping[str, Any] | None:
    """The best trial that did not fail (the table is best first), or None: an errored trial is never the best."""
    return next((r for r in table if r[f"best_{metric}"] is not None and r["state"] != "error"), None)


def command_line(job: str, fixed: Sequence[str], config_file: str | None, row: Mapping[str, Any]) -> str:
    """``raylane run JOB --set ...`` with the fixed values and the trial's searched ones."""
    def text(v: Any) -> str:  # a string quoted, so that YAML keeps "null" or "1e-3" a string
        return json.dumps(v) if isinstance(v, str) else repr(v)

    sets = list(fixed) + [f"{k[len('config/'):]}={text(v)}" for k, v in row.items() if k.startswith("config/")]
    parts = ["raylane", "run", job] + (["--config", config_file] if config_file else [])
    for s in sets:
        parts += ["--set", s]
    return " ".join(shlex.quote(p) for p in parts)


def write(folder: Path, table: list[dict[str, Any]], metric: str) -> dict[str, Path]:
    """``trials.csv``, ``trials.json`` and ``<metric>_vs_time.png`` in ``folder``."""
    folder = Path(folder)
    out = {"json": folder / "trials.json", "csv": folder / "trials.csv"}
    out["json"].write_text(json.dumps(table, indent=1, default=str) + "\n")
    keys = list(dict.fromkeys(k for r in table for k in r))
    with out["csv"].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in table:
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    png = plot_trials(folder, table, metric)
    if png is not None:
        out["png"] = png
    return out


def plot_trials(folder: Path, table: list[dict[str, Any]], metric: str) -> Path | None:
    """The metric against seconds since the search's first step, one line per trial; never raises."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from raylane.plots import plot_filename

        series = []
        for r in (r for r in table if r["run_dir"]):
            pts = [(m["time"], float(m[metric])) for m in read_jsonl(Path(r["run_dir"]) / "metrics.jsonl") if _num(m.get(metric)) is not None]
            if pts:
                series.append((r["trial"], pts))
        if not series:
            return None
        t0 = min(p[0][0] for _, p in series)
        fig = Figure(figsize=(7, 4.5))
        ax = fig.add_subplot(1, 1, 1)
        for name, pts in series:
            ax.plot([t - t0 for t, _ in pts], [v for _, v in pts], marker=".", label=name)
        ax.set_xlabel("seconds since the search's first step")
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
        path = folder / plot_filename(f"{metric}_vs_time")
        FigureCanvasAgg(fig).print_png(str(path))
        return path
    except Exception as exc:  # noqa: BLE001 - a plot must not fail the search
        log.warning("trials plot not written: %s", exc)
        return None


def table(rows_: list[dict[str, Any]], metric: str) -> Any:
    """A rich table of the rows (best first)."""
    from rich.table import Table

    t = Table(title=f"trials, best {metric} first")
    keys = [k for k in dict.fromkeys(k for r in rows_ for k in r) if k.startswith("config/")]
    cols = ["trial", *keys, f"best_{metric}", f"last_{metric}", "steps", "state", "restarts", "exploits", "failures_recovered"]
    short = {f"best_{metric}": "best", f"last_{metric}": "last", "failures_recovered": "recovered"}
    for c in cols:
        # fold, never an ellipsis: a narrow terminal must not hide a trial id or a value
        t.add_column(short.get(c, c.removeprefix("config/")), justify="left" if c in ("trial", "state") else "right", overflow="fold")
    for r in rows_:
        t.add_row(*[f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    return t
