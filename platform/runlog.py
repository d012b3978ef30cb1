"""A run's folder: ``metrics.jsonl`` (one line per step), ``events.jsonl`` (recoveries,
checkpoints, preemptions, scaling), ``summary.json`` at the end, TensorBoard scalars
under ``tb/``, and a live rich progress bar on the terminal."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
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
        self._event_error = ""
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
        try:
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
        finally:  # whatever happened, later steps still have their file
            self._metrics = open(path, "a", buffering=1)
        if gone and self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()  # TensorBoard hides events at or past purge_step written before it
            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"), purge_step=step + 1)
        if gone:
            self.event("metrics_rewound", step=step, discarded=len(gone), reason=reason)
        return len(gone)

    def last_metrics(self, step: int) -> dict[str, Any]:
        """The newest row of ``step`` in ``metrics.jsonl``, without its step and time ({} if none)."""
        self._metrics.flush()
        rows = [r for r in read_jsonl(self.dir / "metrics.jsonl") if r.get("step") == step]
        return {k: v for k, v in rows[-1].items() if k not in ("step", "time")} if rows else {}

    def event(self, kind: str, **data: Any) -> None:
        try:
            self._events.write(json.dumps({"time": time.time(), "event": kind, **_clean(data)}) + "\n")
        except OSError as exc:
            # A full disk or a folder made read-only: an event must not hide how the run ends
            # (the step's metrics row or checkpoint fails too, and says so); said once.
            if not self._event_error:
                self._event_error = f"{type(exc).__name__}: {exc}"
                say(f"events.jsonl of {self.dir} refuses writes ({self._event_error}); events from here on are lost")

    def summary(self, data: Mapping[str, Any]) -> Path:
        """``summary.json`` in the run folder; if the folder refuses it (a full disk, a folder
        made read-only), in ``<tmp>/raylane-summaries/`` instead, said on the terminal."""
        text = json.dumps(_clean(dict(data)), indent=2) + "\n"
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
            return path
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            why = f"{type(exc).__name__}: {exc}"
        elsewhere = Path(tempfile.gettempdir()) / "raylane-summaries" / f"{self.dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        elsewhere.parent.mkdir(parents=True, exist_ok=True)
        elsewhere.write_text(json.dumps({**_clean(dict(data)), "summary_moved": f"{path} refused it ({why})"}, indent=2) + "\n")
        say(f"summary.json could not be written to {self.dir} ({why}); it is at {elsewhere}")
        return elsewhere

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
    """A rich progress bar toward the stop rule that will end the run first, its rate since
    this invocation began, and the main metrics. A no-op when disabled.

    Each update gets the run's measures as ``(done, total, unit)``: driver steps toward
    ``max_steps``, seconds toward ``max_wall_s``, and the workload's own (env steps, rounds,
    batches). The bar shows the one furthest along, the rule that will stop the run."""

    def __init__(self, enabled: bool, metrics: Sequence[str], description: str):
        self._p = None
        self.metrics = tuple(metrics)
        self._first: dict[str, tuple[float, float]] = {}  # unit -> (done, time) when first seen
        if not enabled:
            return
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

        self._p = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[metric]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._task = self._p.add_task(description, total=None, count="", rate="", metric="")
        self._p.start()

    def begin(self, step: int) -> None:
        """The loop starts at ``step`` (0, or the checkpoint resumed from): rates count from here."""
        self._first["steps"] = (float(step), time.monotonic())

    @staticmethod
    def pick(measures: Sequence[tuple[float, float, str]]) -> tuple[float, float, str] | None:
        """The measure furthest along its total (the stop rule that will end the run first)."""
        usable = [m for m in measures if m[1] and m[1] > 0 and math.isfinite(m[0]) and math.isfinite(m[1])]
        return max(usable, key=lambda m: m[0] / m[1]) if usable else None

    def rate(self, done: float, unit: str, now: float | None = None) -> float | None:
        """``unit`` per second since it was first seen in this invocation; None until it moved."""
        now = time.monotonic() if now is None else now
        d0, t0 = self._first.setdefault(unit, (done, now))
        return (done - d0) / (now - t0) if done > d0 and now > t0 else None

    def update(self, step: int, metrics: Mapping[str, Any], measures: Sequence[tuple[float, float, str]] = ()) -> None:
        if self._p is None:
            return
        chosen = self.pick(measures) or (float(step), 0.0, "steps")
        done, total, unit = chosen
        for d, _, u in measures:
            self._first.setdefault(u, (d, time.monotonic()))
        r = self.rate(done, unit)
        shown = " ".join(
            f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}" for k in self.metrics if k in metrics
        )
        count = f"{done:,.0f}/{total:,.0f} {unit}" if total else f"{done:,.0f} {unit}"
        self._p.update(self._task, completed=done, total=total or None, count=count,
                       rate="" if r is None else f"{r:,.3g} {unit}/s", metric=shown)

    def log(self, text: str) -> None:
        if self._p is not None:
            self._p.console.print(text)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
