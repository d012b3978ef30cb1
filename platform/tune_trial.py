"""One Ray Tune trial is one raylane run.

Each trial builds the job's config from the search's fixed values and the trial's
sampled ones, and drives the job with raylane's own driver in the trial's process: its
actors are planned by raylane's placement (stateful roles on on-demand capacity,
stateless ones on spot, by node speed), its pools replace actors lost with a spot node,
and its stateful actors are recovered from its checkpoints, all inside the trial.

The driver tells :class:`TuneReporter` of every step and checkpoint: metrics go to Tune
every step, and a raylane checkpoint written since the last step is handed to Tune with
them, so Tune holds the trial's newest checkpoint. When Tune restarts the trial (its driver's
process or node was lost, or population-based training exploits another trial) the
trial's store adopts the checkpoint Tune hands back and the run resumes from it with the
trial's config of now; both are events in the trial's ``events.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ray.tune import Trainable

from raylane.tune_space import trial_config

ORIGIN = "raylane_origin.json"  # beside a checkpoint handed to Tune: which trial and step it is
STOP_WAIT_S = 120.0  # how long a stopped trial waits for its run's last checkpoint and summary


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


class TuneReporter:
    """The driver's observer in a trial: hands each step's metrics to the trial's ``step``
    and waits there until Tune asks for the next, so that Tune's decisions (stop, exploit)
    land at the step boundary they were made for."""

    def __init__(self, trial_id: str, metric: str, job: str):
        self.trial_id, self.metric, self.job = trial_id, metric, job
        self.rows: queue.Queue = queue.Queue()
        self.go = threading.Semaphore(0)
        self.latest: tuple[int, str] | None = None  # the newest checkpoint written: (step, path in the store)
        self.fresh = False  # a checkpoint was written since the last row handed over
        self.driver: Any = None
        self.stopping = False
        self.declared = False  # the job declares its metrics: steps without the metric are not handed to Tune
        self.reported = False  # a step with the metric has been handed over

    def checkpointed(self, step: int, path: str) -> None:
        self.latest, self.fresh = (step, path), True

    def stepped(self, step: int, metrics: Mapping[str, Any]) -> None:
        from raylane.workload import DriverError

        row = {**scalars(metrics), "step": step}
        self.final_row = row
        value = row.get(self.metric)
        last = step >= self.driver.config.max_steps or self.driver.state.value == "finished"
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            # No value at this step (evaluated at an epoch's end only; no episode ended yet):
            # Tune hears of the trial at the next step that has one (its time is the step).
            if not self.declared and not self.reported and value is None:
                have = sorted(k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
                raise DriverError(f"--metric {self.metric!r}: job {self.job!r} did not report it at step {step}; it reports {have} "
                                  "(a workload that reports it only at some steps declares it in its `metrics`)")
            return
        self.reported = True
        self.last_row = row
        if last:  # handed over once the run has ended (summary and final checkpoint written)
            return
        self.rows.put(("step", row))
        self.go.acquire()  # until Tune asks for the next step, or stops the trial


class RaylaneTrial(Trainable):
    """Ray Tune's class trainable around one raylane run, driven in a thread of the trial's
    process. ``step`` returns the driver's next step; a raylane checkpoint written since
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
        conf = trial_config(self.spec.config_cls, config, plan.config_file, plan.overrides)
        conf.driver.run_name, conf.driver.runs_dir = self.trial_id, plan.runs_root
        conf.driver.progress, conf.driver.resume = False, True
        self.conf, self.run_dir = conf, Path(plan.runs_root) / self.trial_id
        self.store = CheckpointStore(conf.driver.store_uri(self.run_dir), keep=conf.driver.keep_checkpoints)
        self.reporter = TuneReporter(self.trial_id, plan.metric, self.spec.name)
        self.restored: dict | None = None
        self.thread: threading.Thread | None = None
        self.outcome: dict = {}

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
        from raylane import runconfig
        from raylane.driver import Driver
        from raylane.launch import build_workload
        from raylane.runlog import RunLog

        changes = runconfig.check_resume(self.spec.name, self.conf, self.run_dir, accept_changes=True)
        workload = build_workload(self.spec, self.conf)
        runconfig.write_record(self.spec.name, self.conf, self.run_dir)
        log = RunLog(self.run_dir, tensorboard=False)
        log.event("tune_trial", trial=self.trial_id, values=self.values, metric=self.plan.metric, pid=os.getpid(), node=_node_id())
        if self.restored is not None:
            log.event(**self.restored)
        if changes:
            log.event("config_changed", changes=[{"key": k, "run": a, "now": b} for k, a, b in changes])
        log.close()
        self.reporter.declared = self.plan.metric in tuple(getattr(workload, "metrics", ()) or ())
        self.reporter.driver = Driver(workload, self.conf.driver, observer=self.reporter)
        self.thread = threading.Thread(target=self._drive, name=f"raylane-trial-{self.trial_id}", daemon=True)
        self.thread.start()

    def _drive(self) -> None:
        try:
            self.outcome["summary"] = self.reporter.driver.run()
        except BaseException as exc:  # noqa: BLE001 - handed to step(), which raises it in Tune's thread
            self.outcome["error"] = exc
        finally:
            self.reporter.rows.put(("end", None))

    def step(self) -> dict:
        from ray.tune.result import DONE, SHOULD_CHECKPOINT

        r = self.reporter
        if self.thread is None:
            self._start()
        else:
            r.go.release()  # the driver may run its next step
        while True:  # every wait inside the driver has its own deadline, and its thread always ends with "end"
            try:
                kind, row = r.rows.get(timeout=5.0)
                break
            except queue.Empty:
                if not self.thread.is_alive() and r.rows.empty():
                    raise RuntimeError(f"trial {self.trial_id}: its driver thread ended without a word") from None
        fresh, r.fresh = r.fresh, False
        if kind == "step":
            return {**row, SHOULD_CHECKPOINT: fresh}
        self.thread.join(timeout=60)
        if "error" in self.outcome:
            raise self.outcome["error"]
        # The last step with the metric; a run that never had it (it ended before its first
        # evaluation) ends with NaN, which Tune ranks last, rather than a made-up value.
        final = getattr(r, "last_row", None)
        if final is None:
            final = {**getattr(r, "final_row", {}), r.metric: float("nan")}
            self._no_metric(final.get("step"))
        return {**final, DONE: True, SHOULD_CHECKPOINT: r.latest is not None}

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

        if self.reporter.latest is None:
            return None
        step, path = self.reporter.latest
        pafs.copy_files(path, checkpoint_dir, source_filesystem=self.store.fs, destination_filesystem=pafs.LocalFileSystem())
        (Path(checkpoint_dir) / ORIGIN).write_text(json.dumps({"trial": self.trial_id, "step": step}))
        return None

    def cleanup(self) -> None:
        r = self.reporter
        if self.thread is not None and self.thread.is_alive():
            r.driver.request_stop("stopped by Ray Tune's scheduler")
            r.go.release()
            self.thread.join(timeout=STOP_WAIT_S)


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
