"""One Ray Tune trial is one raylane run.

Each trial builds the job's config from the search's fixed values and the trial's
sampled ones, and drives the job with raylane's own driver in the trial's process: its
actors are planned by raylane's placement (stateful roles on on-demand capacity,
stateless ones on spot, by node speed), its pools replace actors lost with a spot node,
and its stateful actors are recovered from its checkpoints, all inside the trial.

The trial steps the driver itself: metrics go to Tune at every step that has a value of
the metric, and a raylane checkpoint written since the last such step is handed to Tune with
them, so Tune holds the trial's newest checkpoint. When Tune restarts the trial (its driver's
process or node was lost, or population-based training exploits another trial) the
trial's store adopts the checkpoint Tune hands back and the run resumes from it with the
trial's config of now; both are events in the trial's ``events.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ray.tune import Trainable

from raylane.tune.space import trial_config

ORIGIN = "raylane_origin.json"  # beside a checkpoint handed to Tune: which trial and step it is


@dataclass(frozen=True)
class TrialPlan:
    """What every trial of one search shares."""

    job: str
    """The job: a registered name, path/to/file.py:NAME or package.module:NAME."""
    overrides: tuple[str, ...]
    """``key=value`` values fixed for every trial (``--set``)."""
    config_file: str | None
    """YAML file of fixed values, or None."""
    runs_root: str
    """Folder of the trials' run folders (``<runs_root>/<trial id>/``)."""
    metric: str
    """The metric the search optimises; every step must report it."""


def scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics Tune can store and compare: numbers, flags and short strings (lists and
    tables stay in the run's metrics.jsonl)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or (isinstance(v, str) and len(v) <= 200):
            out[k] = v
        elif isinstance(v, (int, float)) or type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0:
            out[k] = v.item() if hasattr(v, "item") else v
    return out


class TuneReport:
    """Which of a run's steps Ray Tune hears of: those with a finite value of the metric,
    except the run's last step, whose row Tune gets once the run has ended (its summary and
    final checkpoint written)."""

    def __init__(self, trial_id: str, metric: str, job: str, declared: bool):
        self.trial_id, self.metric, self.job = trial_id, metric, job
        self.declared = declared  # the job declares its metrics: steps without the metric are not handed to Tune
        self.last_row: dict | None = None  # the newest step with a value of the metric
        self.final_row: dict = {}  # the newest step

    def row(self, step: int, metrics: Mapping[str, Any]) -> dict | None:
        """The row for Tune of step ``step``, or None when it has no value of the metric (an
        evaluation only at an epoch's end; no episode ended yet). An undeclared metric missing
        from the first step is refused, naming what the job does report."""
        from raylane.workload import DriverError

        row = {**scalars(metrics), "step": step}
        self.final_row = row
        value = row.get(self.metric)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            if not self.declared and self.last_row is None and value is None:
                have = sorted(k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
                raise DriverError(f"--metric {self.metric!r}: job {self.job!r} did not report it at step {step}; it reports {have} "
                                  "(a workload that reports it only at some steps declares it in its `metrics`)")
            return None
        self.last_row = row
        return row


class RaylaneTrial(Trainable):
    """Ray Tune's class trainable around one raylane run, stepped in the trial's process:
    ``step`` runs the driver's steps up to the next one with a value of the metric; a raylane checkpoint written since
    the last step is handed to Tune with it (``should_checkpoint``: Tune calls
    ``save_checkpoint``, which copies it); ``load_checkpoint`` adopts the checkpoint Tune
    restores (the trial's own after a lost process, another trial's under PBT);
    ``cleanup`` (Tune stopped the trial: ASHA, PBT's pause, the search's end) stops the run
    at its step boundary with a checkpoint and waits for it."""

    def setup(self, config: dict, plan: TrialPlan) -> None:
        from raylane import registry
        from raylane.checkpoint import CheckpointStore

        self.plan, self.values = plan, dict(config)
        self.spec = registry.get(plan.job)
        conf = trial_config(self.spec, config, plan.config_file, plan.overrides)
        conf.driver.run_name, conf.driver.runs_dir = self.trial_id, plan.runs_root
        conf.driver.progress, conf.driver.resume = False, True
        self.conf, self.run_dir = conf, Path(plan.runs_root) / self.trial_id
        self.store = CheckpointStore(conf.driver.store_uri(self.run_dir), keep=conf.driver.keep_checkpoints)
        self.report: TuneReport | None = None
        self.driver: Any = None
        self.restored: dict | None = None
        self.latest: tuple[int, str] | None = None  # the newest checkpoint written: (step, path in the store)
        self.fresh = False  # a checkpoint was written since the last row handed over

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        try:
            origin = json.loads((Path(checkpoint_dir) / ORIGIN).read_text())
        except (OSError, ValueError):
            origin = {}
        donor = origin.get("trial", self.trial_id)
        # Tune hands back this trial's own state (a restore after its process was lost) or
        # another trial's (PBT's exploit). An exploited trial lost before its first own
        # checkpoint gets the donor's copy again: the copy its store adopted, with its values.
        ours = donor == self.trial_id or self._adopted(origin)
        if ours and "step" in origin:
            # Tune copies a checkpoint after the step that wrote it is reported; a process lost
            # in between leaves the trial's own store one checkpoint ahead of Tune's copy.
            own = self.store.latest()
            if own is not None and own.step > int(origin["step"]):
                self.restored = {"kind": "tune_restore", "step": own.step, "donor": donor, "path": own.path,
                                 "tune_step": int(origin["step"]),
                                 "why": "the trial's own store holds a newer checkpoint than Ray Tune's copy"}
                return
        step = self.store.adopt(checkpoint_dir)
        if donor != self.trial_id:  # noted beside the adopted checkpoint: a later restore of it is not an exploit
            with self.store.fs.open_output_stream(f"{self.store.root}/{step:010d}/{ORIGIN}", compression=None) as f:
                f.write(self._adoption(origin).encode())
        self.restored = {"kind": "tune_restore" if ours else "tune_exploit", "step": step, "donor": donor, "path": checkpoint_dir}

    def _adopted(self, origin: dict) -> bool:
        """Whether the store holds ``origin``'s checkpoint, adopted by this trial with its values of now."""
        if "step" not in origin:
            return False
        try:
            with self.store.fs.open_input_stream(f"{self.store.root}/{int(origin['step']):010d}/{ORIGIN}", compression=None) as f:
                held = json.loads(f.read())
        except (OSError, ValueError, TypeError):
            return False
        return held == json.loads(self._adoption(origin))

    def _adoption(self, origin: dict) -> str:
        return json.dumps({**origin, "values": self.values}, sort_keys=True, default=str)

    def _start(self) -> None:
        from raylane import prepare, runrecord
        from raylane.driver import Driver
        from raylane.watchers import RunPlot

        changes = runrecord.check_resume(self.spec.name, self.conf, self.run_dir, accept_changes=True)
        events = [{"kind": "tune_trial", "trial": self.trial_id, "values": self.values, "metric": self.plan.metric, "pid": os.getpid(), "node": _node_id()}]
        workload = prepare.begin(self.spec, self.conf, self.run_dir, changes, events + ([self.restored] if self.restored is not None else []), quiet=True)
        self.report = TuneReport(self.trial_id, self.plan.metric, self.spec.name, self.plan.metric in tuple(workload.metrics or ()))
        # No signal handlers, watchdog or progress bar in a trial: Tune owns the process.
        self.driver = Driver(workload, self.conf.driver, watchers=[RunPlot()])
        self.driver.start()

    def step(self) -> dict:
        from ray.tune.result import DONE, SHOULD_CHECKPOINT

        from raylane.run_state import State

        if self.driver is None:
            self._start()
        d, report = self.driver, self.report
        while True:  # every wait inside a step has its own deadline
            try:
                result = d.step()
                row = report.row(result.step, result.metrics) if result.metrics else None
            except BaseException as exc:  # noqa: BLE001 - the run ends here: finish() writes its summary and raises
                d.failed(exc)
                d.finish()
                raise
            if result.checkpoint is not None:
                self.latest, self.fresh = result.checkpoint, True
            if result.state is not State.RUNNING:
                break
            if row is not None and result.step < d.config.max_steps:  # the last step's row waits for the run's end
                fresh, self.fresh = self.fresh, False
                return {**row, SHOULD_CHECKPOINT: fresh}
        d.finish()  # raises if the run failed
        # The last step with the metric; a run that never had it (it ended before its first
        # evaluation) ends with NaN, which Tune ranks last, rather than a made-up value.
        final = report.last_row
        if final is None:
            final = {**report.final_row, report.metric: float("nan")}
            self._no_metric(final.get("step"))
        return {**final, DONE: True, SHOULD_CHECKPOINT: self.latest is not None}

    def _no_metric(self, step: Any) -> None:
        """Say (terminal and the run's events) that the run ended without a value of the metric."""
        from raylane.runlog import RunLog, say

        text = f"trial {self.trial_id}: the run ended at step {step} without a value of {self.plan.metric!r}; Tune ranks it last (NaN)"
        say(text)
        log = RunLog(self.run_dir, tensorboard=False)
        log.event("tune_no_metric", metric=self.plan.metric, step=step, message=text)
        log.close()

    def save_checkpoint(self, checkpoint_dir: str) -> dict | None:
        """The newest raylane checkpoint, copied whole, with a note of which trial and step it is."""
        import pyarrow.fs as pafs

        if self.latest is None:
            return None
        step, path = self.latest
        pafs.copy_files(path, checkpoint_dir, source_filesystem=self.store.fs, destination_filesystem=pafs.LocalFileSystem())
        (Path(checkpoint_dir) / ORIGIN).write_text(json.dumps({"trial": self.trial_id, "step": step}))
        return None

    def cleanup(self) -> None:
        """Tune stopped the trial: the run stops at this step boundary with a checkpoint."""
        from raylane.run_state import State

        if self.driver is not None and self.driver.state is State.RUNNING:
            self.driver.request_stop("stopped by Ray Tune's scheduler")
            try:
                self.driver.finish()
            except Exception:  # noqa: BLE001 - the run's own folder says how it ended; Tune stops the trial either way
                pass


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
