"""A run's folder: ``metrics.jsonl`` (one line per step), ``events.jsonl`` (recoveries,
checkpoints, preemptions, scaling), ``summary.json`` at the end, TensorBoard scalars
under ``tb/``, and a live rich progress bar on the terminal."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


class RunLog:
    """Appends a run's records; safe to reopen after a restart (files are appended to)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._events = open(self.dir / "events.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"))

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **_clean(dict(values))}
        self._metrics.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)

    def rewind(self, step: int, reason: str) -> int:
        """The run goes back to ``step`` (a checkpoint reloaded after a failure or a
        restart): rows past it leave ``metrics.jsonl`` for ``metrics.discarded.jsonl``, and
        TensorBoard hides its points past it, so every reader sees one value per step.
        Returns how many rows were moved."""
        path = self.dir / "metrics.jsonl"
        self._metrics.close()
        rows = read_jsonl(path)
        keep = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= step]
        gone = [r for r in rows if isinstance(r.get("step"), int) and r["step"] > step]
        if gone:
            with open(self.dir / "metrics.discarded.jsonl", "a") as f:
                for r in gone:
                    f.write(json.dumps({**r, "discarded": reason}) + "\n")
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, path)
        self._metrics = open(path, "a", buffering=1)
        if gone and self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()  # TensorBoard hides events at or past purge_step written before it
            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"), purge_step=step + 1)
        if gone:
            self.event("metrics_rewound", step=step, discarded=len(gone), reason=reason)
        return len(gone)

    def event(self, kind: str, **data: Any) -> None:
        self._events.write(json.dumps({"time": time.time(), "event": kind, **_clean(data)}) + "\n")

    def summary(self, data: Mapping[str, Any]) -> Path:
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_clean(dict(data)), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        self._metrics.close()
        self._events.close()
        if self._tb is not None:
            self._tb.close()


def say(message: str) -> None:
    """A line for the person at the terminal (the run's events record the same)."""
    print(f"raylane: {message}", file=sys.stderr, flush=True)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, skipping a torn last line (a killed writer)."""
    rows = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class Progress:
    """A rich progress bar: steps, rate and the main metric. A no-op when disabled."""

    def __init__(self, enabled: bool, total: int | None, metrics: Sequence[str], description: str):
        self._p = None
        self.metrics = tuple(metrics)
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._p = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[metric]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._task = self._p.add_task(description, total=total, rate="", metric="")
        self._p.start()
        self._t0 = time.monotonic()
        self._s0: int | None = None

    def update(self, step: int, metrics: Mapping[str, Any], extra: str = "") -> None:
        if self._p is None:
            return
        if self._s0 is None:
            self._s0, self._t0 = step - 1, time.monotonic() - 1e-9
        rate = (step - self._s0) / max(time.monotonic() - self._t0, 1e-9)
        shown = " ".join(
            f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}" for k in self.metrics if k in metrics
        )
        self._p.update(self._task, completed=step, rate=f"{rate:.2f} steps/s", metric=(shown + " " + extra).strip())

    def log(self, text: str) -> None:
        if self._p is not None:
            self._p.console.print(text)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
