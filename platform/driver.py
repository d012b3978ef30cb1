"""The driver runs one workload, one step at a time (states: :mod:`raylane.run_state`).

:meth:`Driver.start` locks the run folder, plans the roles, lets the workload build itself
(its groups come from the context and belong to the driver: :mod:`raylane.group.registry`)
and resumes from the newest checkpoint. :meth:`Driver.step` runs a step, then logs metrics,
reacts to node events (:mod:`raylane.node_events`), resizes pools (:mod:`raylane.elastic`)
and checkpoints (:mod:`raylane.checkpoint_cadence`); a failed step is recovered
(:mod:`raylane.recovery`). :meth:`Driver.finish` writes the summary, shuts the groups down
and raises if the run failed. Signals, progress and plots wrap it (:mod:`raylane.watchers`).
A workload implements :class:`Workload`; the driver never imports one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from raylane.best import Best, Verdict, rule_for
from raylane.best_store import BestStore
from raylane.checkpoint import CheckpointInfo, CheckpointStore, CheckpointWriteError
from raylane.cluster import ClusterView
from raylane.elastic import Elasticity
from raylane.errors import GroupLost
from raylane.group import Groups
from raylane.node_events import NodeReactions
from raylane.placement import plan_when_free
from raylane.role_markets import check_spot_roles
from raylane.checkpoint_cadence import CheckpointPolicy, Checkpointer
from raylane.policies import FailurePolicy, ScalingPolicy, non_finite
from raylane.recovery import Recovery
from raylane.preemption import PreemptionMonitor
from raylane.runlock import RunBusy, RunLock
from raylane.runlog import RunLog, say as _say
from raylane.run_state import State, StateMachine, Stepped  # noqa: F401 - also raylane.driver's
from raylane.runpaths import check_run_name
from raylane.watchers import Watcher, default_watchers
from raylane.workload import (  # noqa: F401 - the contract's names are also raylane.driver's
    BaseWorkload, Context, DriverConfig, DriverError, NonFiniteError, RayGone, RunAborted, Workload, check_workload, default_run_name,
)

log = logging.getLogger(__name__)


class Driver(StateMachine):
    """Runs ``workload`` under ``config``: :meth:`start`, :meth:`step` until the state is not
    RUNNING, :meth:`finish` (the summary dict); :meth:`run` does all three."""

    def __init__(self, workload: Workload, config: DriverConfig, *, failure_policy: FailurePolicy | None = None,
                 scaling_policy: ScalingPolicy | None = None, poll_events: bool = True, cluster_source: Callable[[], ClusterView] | None = None,
                 event_source: Any = None, watchers: Sequence[Watcher] | None = None, before_step: Callable[[int], Any] | None = None):
        """``cluster_source`` (snapshots) and ``event_source`` (``poll() -> [events]``) read Ray by
        default; ``watchers`` wrap the run (default: :func:`raylane.watchers.default_watchers`);
        ``before_step(i)`` runs just before the workload's step ``i``, as part of it."""
        self.run_name = check_run_name(config.run_name or default_run_name(workload.name), "driver.run_name")
        check_workload(workload)
        self.workload, self.config = workload, config
        self._cluster_source = cluster_source or ClusterView.from_ray
        self.run_dir = Path(config.runs_dir) / self.run_name
        self._recovery = Recovery(failure_policy or FailurePolicy(max_failures=config.max_failures, max_recovery_s=config.max_recovery_s))
        self.poll_events, self._monitor = poll_events, event_source
        self.watchers = list(default_watchers(config) if watchers is None else watchers)
        self.before_step = before_step
        super().__init__()
        self.resumed_from: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.end_reason: str | None = None  # why the run FINISHED or STOPPED
        self.started_at = time.time()
        try:
            rule = rule_for(config, workload)
        except ValueError as exc:
            raise DriverError(str(exc)) from None
        self._best = Best(rule) if rule is not None else None
        self._best_store: BestStore | None = None
        self._best_pending: int | None = None  # the step whose checkpoint is to be kept as the best once committed
        self.best_kept: dict[str, Any] | None = None
        self._best_failed_said = False
        self._ckpt: Checkpointer | None = None
        self._ctx: Context | None = None
        self._nodes: NodeReactions | None = None
        self._lock: RunLock | None = None
        self._elastic = Elasticity(workload, autoscale=config.autoscale, pool_autoscale=config.pool_autoscale,
                                   scaling_policy=scaling_policy or ScalingPolicy(grow=config.autoscale), cluster_source=self._cluster_source, run_name=self.run_name)

    def run(self) -> dict[str, Any]:
        try:
            self.start()
            while self.step().state is State.RUNNING:
                pass
        except BaseException as exc:  # noqa: BLE001 - finish() raises it after the summary
            self.failed(exc)
        return self.finish()

    def start(self) -> None:
        """Lock the run folder, plan, set the workload up, resume or write the initial checkpoint."""
        if self._lock is not None or self._error is not None:
            raise RuntimeError("Driver.start() is called once")
        self.started_at = time.time()
        try:
            lock = RunLock(self.run_dir)
            lock.acquire()  # before anything is read or written in the run folder
        except RunBusy as exc:
            self._error = DriverError(str(exc))
            raise self._error from None
        self._lock = lock
        with self.recording():
            self.log = RunLog(self.run_dir, tensorboard=self.config.tensorboard)
            if lock.took_over:
                _say(lock.took_over)
                self.log.event("run_lock_taken_over", reason=lock.took_over)
            for w in self.watchers:
                w.opened(self)
            self._initialize(CheckpointStore(self.config.store_uri(self.run_dir), keep=self.config.keep_checkpoints))
            self.to(State.RUNNING, "initialized")
            for w in self.watchers:
                w.running(self)

    def step(self) -> Stepped:
        """One step and what follows it (metrics, node events, pool sizes, a checkpoint by
        policy), or the end of the run when a stop rule or a stop request says so."""
        if self.state is not State.RUNNING:
            raise RuntimeError(f"Driver.step() on a run that is {self.state.value}")
        assert self._ckpt is not None
        self._ckpt.newest_written = None  # what this call writes, it reports
        with self.recording():
            result = self._one_step()
            for w in self.watchers:
                w.stepped(self, result)
            return result

    def finish(self) -> dict[str, Any]:
        """Write the summary, shut the groups down, free the run folder; raise if the run failed."""
        if self._lock is None:  # never started (the folder is another run's): nothing was written
            raise self._error or RuntimeError("Driver.finish() before start()")
        if self._error is None and self.state is State.RUNNING:  # the caller ends the run between steps: a stop
            self.request_stop(self.stop_reason or "finished by its caller")
            try:
                self.step()
            except BaseException:  # noqa: BLE001 - recorded by step()
                pass
        error = self._error
        if self.log is None:  # the run log could not be opened: nothing else was started
            self._lock.release()
            raise error or RuntimeError("the run log did not open")
        for w in self.watchers:
            _quietly(w.ended, self)
        self._elastic.close(self.state.value)
        summary = self.summary(error)
        if self.ran or not (self.run_dir / "summary.json").exists():
            self.log.summary(summary)
        else:  # a run that could not start keeps the summary of the run it was to continue
            self.log.event("start_failed", error=summary["error"])
        for w in self.watchers:
            _quietly(w.closed, self, summary)
        _quietly(self.log.close)  # the last lines may not flush (a full disk): the summary says how the run ended
        if self._ckpt is not None:
            _quietly(self._ckpt.close)
        if self._ctx is not None:
            _quietly(self._ctx.groups.shutdown)
        _quietly(self.workload.close)
        self._lock.release()
        if error is None:
            return summary
        raise self.outcome(error, self.run_name, self.checkpoint_hint())

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary: checkpoint, end-of-run hook, STOPPED (any thread, or a signal handler)."""
        self.stop_reason = reason

    def _initialize(self, store: CheckpointStore) -> None:
        assert self.log is not None
        runlog = self.log
        try:
            roles = self.config.with_markets(list(self.workload.roles()))
        except ValueError as exc:
            raise DriverError(str(exc)) from None
        # Elastic roles are planned at the size asked for (want), fixed ones at their count:
        # the plan is what starts, and the groups are sized from it.
        counts = {r.name: r.want for r in roles if r.want is not None}

        def waiting(exc: Exception) -> None:
            _say(f"waiting up to {self.config.placement_wait_s:g} s for busy capacity to free: {str(exc).splitlines()[0]}")
            runlog.event("placement_wait", wait_s=self.config.placement_wait_s, error=str(exc))

        cluster, the_plan = plan_when_free(roles, self._cluster_source, self.config.placement_wait_s, waiting, counts)
        ctx = self._ctx = Context(cluster, the_plan, store, self.run_dir, runlog, Groups(roles, the_plan, spares=self.config.hot_spares))
        self._ckpt = Checkpointer(store, CheckpointPolicy(self.config.checkpoint_every_steps, self.config.checkpoint_every_s), runlog)
        self._ckpt.replicate(self.config.replicate_every_steps, lambda: ctx.cluster)
        self._ckpt.on_commit = self._committed
        if self._best is not None and self._best.rule.keep:
            self._best_store = BestStore(store)
            kept = self._best_store.record()  # a resumed run's copy, if it was kept under the same rule
            self.best_kept = kept if kept and (kept.get("metric"), kept.get("mode")) == (self._best.rule.metric, self._best.rule.mode) else None
        runlog.event("plan", assignments=[a.__dict__ for a in the_plan.assignments])
        check_spot_roles(roles, the_plan, cluster)
        short = self._elastic.report_shortfalls(roles, the_plan, runlog)
        self.workload.setup(ctx)
        ctx.groups.ready()
        self._spares_said(ctx.groups, runlog)
        self._elastic.start(ctx, self.steps_done, control=self.config.control)
        self._elastic.keep_asks(short)
        if self.poll_events and self._monitor is None:
            self._monitor = PreemptionMonitor()
        self._nodes = NodeReactions(self._monitor, ctx.groups, self.workload, runlog, self._elastic, self._refresh_cluster, self.started_at)
        latest, state = self._ckpt.resume_point(self.config.resume, self.run_name)
        if latest is not None:
            self._load(latest.step, state)
            self.resumed_from = latest.step
            # The values the run had at that step: a run resumed where it already ends keeps them in its summary.
            self.last_metrics = runlog.last_metrics(latest.step)
            runlog.event("resume", step=latest.step, path=latest.path)
            _say(f"resuming run {self.run_name!r} from step {latest.step} (checkpoint {latest.path})")
            return
        runlog.rewind(0, "no checkpoint to resume from: the run starts over")  # rows of an earlier start leave
        # The initial state, so that a failure before the first periodic checkpoint still has something consistent to recover to.
        self._checkpoint(force="initial state")

    def _refresh_cluster(self) -> None:
        self._ctx.cluster = self._cluster_source()  # type: ignore[union-attr] - only called once the run has its context

    def _one_step(self) -> Stepped:
        assert self.log is not None and self._nodes is not None and self._ckpt is not None
        try:
            if self.stop_reason:
                return self._end(State.STOPPED, self.stop_reason, force=f"stop requested: {self.stop_reason}")
            if self.steps_done >= self.config.max_steps or (self.config.max_wall_s and time.time() - self.started_at >= self.config.max_wall_s):
                return self._end(State.FINISHED, "stop condition reached")
            if self.before_step is not None:
                self.before_step(self.steps_done)
            metrics = self.workload.step(self.steps_done)
            self._check_finite(metrics)
            self.steps_done += 1
            self.last_metrics = metrics
            self.log.metrics(self.steps_done, {**metrics, **self._elastic.pool_sizes()})
            notice = self._nodes.react(self.steps_done)
            if lost := self._ctx.groups.lost_stateful():  # type: ignore[union-attr]
                # Ray marked their node dead: whatever still answers there (a process that has
                # not yet noticed) is not the run's to keep using; restore them now, from memory.
                raise _lost_ranks(lost, f"stateful ranks {lost} were on a node that was lost by the end of step {self.steps_done}")
            self._elastic.settle()
            self._elastic.control(self.steps_done)
            verdict = self._best.see(self.steps_done, metrics) if self._best is not None else Verdict()
            soon = ""
            if verdict.improved and self._best_store is not None:
                self._best_pending = self.steps_done
                soon = f"best {self._best.rule.metric} so far ({self._best.value:.6g})"  # type: ignore[union-attr]
            self._checkpoint(notice=notice, soon=soon)
            if self.workload.done(self.steps_done, metrics):
                return self._end(State.FINISHED, "workload reached its target", metrics)
            if verdict.stop:
                _say(verdict.stop)
                return self._end(State.FINISHED, verdict.stop, metrics)
            return Stepped(self.state, self.steps_done, metrics, self._ckpt.newest_written)
        except (NonFiniteError, DriverError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - every other failure goes through the policy
            self._recover(exc)
            return Stepped(self.state, self.steps_done, {}, self._ckpt.newest_written, recovered=True)

    def _end(self, state: State, why: str, metrics: dict[str, Any] | None = None, force: str = "") -> Stepped:
        """The final checkpoint, the workload's end-of-run hook, then FINISHED or STOPPED."""
        assert self._ctx is not None and self._ckpt is not None
        self._checkpoint(final=not force, force=force)
        self.workload.finish(self._ctx)
        self.end_reason = why
        self.to(state, why)
        return Stepped(self.state, self.steps_done, metrics or {}, self._ckpt.newest_written)

    def _load(self, step: int, state: dict) -> None:
        assert self.log is not None and self._ckpt is not None
        self.workload.load_state_dict(state["workload"])
        if self._best is not None:  # patience counts on from where the checkpoint was
            self._best.load(state.get("driver", {}).get("best"))
            self._best_pending = None  # a step past the checkpoint: not this run's any more
        self.log.rewind(step, f"replayed from the checkpoint of step {step}")  # steps past it run again: their first values leave
        self.steps_done = step
        self._ckpt.loaded(step)

    def _check_finite(self, metrics: dict[str, Any]) -> None:
        # The main metric is guarded too: a run whose headline number is NaN has not "finished".
        guarded = tuple(dict.fromkeys((*self.workload.guarded_metrics, self.workload.main_metric)))
        if (bad := non_finite(metrics, guarded)) is not None:
            raise NonFiniteError(f"metric {bad[0]!r} is {bad[1]} at step {self.steps_done + 1}; the step's update was not checkpointed. "
                                 f"{self.checkpoint_hint()} Lower the learning rate or check the inputs, then run again with the same run name.")

    def checkpoint_hint(self) -> str:
        return "No checkpoint was written." if self._ctx is None else self._ctx.store.hint()

    def _checkpoint(self, *, notice: bool = False, final: bool = False, force: str = "", soon: str = "") -> None:
        assert self._ckpt is not None
        try:
            self._ckpt.maybe(self.steps_done, lambda: {"workload": self._workload_state(), "driver": self._driver_state()},
                             notice=notice, final=final, force=force, soon=soon)
        except CheckpointWriteError as exc:  # no retry heals a full disk: the run ends here, saying why
            raise DriverError(f"run {self.run_name!r} stopped at step {self.steps_done}: {exc}. {self.checkpoint_hint()}") from exc

    def _driver_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.steps_done, "run": self.run_name, "job": self.workload.name}
        if self._best is not None:
            state["best"] = self._best.state()
        return state

    def _committed(self, info: CheckpointInfo) -> None:
        """A checkpoint was committed: the best evaluation's is copied apart (``keep_best``),
        unless the copy already kept is better (a run that rolled back and did not reach it again)."""
        if self._best_store is None or self._best is None or info.step != self._best_pending or info.step != self._best.step:
            return
        self._best_pending = None
        rule, value = self._best.rule, self._best.value
        kept = self.best_kept
        if (kept is not None and kept.get("metric") == rule.metric and kept.get("mode") == rule.mode
                and kept.get("value") is not None and value is not None and rule.better(float(kept["value"]), value, min_delta=0.0)):
            self.log.event("best_not_replaced", step=info.step, value=value, kept_step=kept["step"], kept_value=kept["value"],  # type: ignore[union-attr]
                           reason="the copy kept is better: it was reached before the run rolled back")
            return
        try:
            self.best_kept = self._best_store.keep(info.step, {"metric": rule.metric, "mode": rule.mode, "value": value}, current=kept)
        except (OSError, ValueError, KeyError) as exc:  # the checkpoint itself is committed: the run goes on, saying so
            why = f"the best checkpoint (step {info.step}, {rule.metric}={value}) could not be copied to {self._best_store.path}: {type(exc).__name__}: {exc}"
            if not self._best_failed_said:
                self._best_failed_said = True
                _say(f"{why}; the run goes on, and the copy is tried again at the next improvement")
            self.log.event("best_not_kept", step=info.step, value=value, reason=why)  # type: ignore[union-attr]
            return
        self.log.event("best_kept", step=info.step, metric=rule.metric, value=value, path=self.best_kept["path"])  # type: ignore[union-attr]

    def _workload_state(self) -> dict:
        """The workload's state; read while a stateful rank is gone (its node was lost at this
        step boundary, after the step), whatever the workload raised is that loss: recoverable."""
        try:
            return self.workload.state_dict()
        except Exception as exc:
            if self._ctx is not None and (lost := self._ctx.groups.lost_stateful()):
                raise _lost_ranks(lost, f"stateful ranks {lost} were lost before their state was read for the checkpoint of step {self.steps_done}") from exc
            raise

    @property
    def checkpoints_written(self) -> int:
        return 0 if self._ckpt is None else self._ckpt.written

    def _recover(self, exc: BaseException) -> None:
        """RECOVERING, then RUNNING again, or FAILED when the failure policy gives up."""
        self.to(State.RECOVERING, f"{type(exc).__name__} at step {self.steps_done}")
        assert self.log is not None
        if (failed := self._recovery.recover(exc, self.steps_done, self._rebuild, self.log)) is not None:
            decision, last = failed
            self.to(State.FAILED, decision.reason)
            raise DriverError(f"run {self.run_name!r} failed at step {self.steps_done}: {decision.reason}\n{self.checkpoint_hint()}") from last
        self.to(State.RUNNING, f"recovered from step {self.steps_done}")

    def _spares_said(self, groups: Groups, runlog: RunLog) -> None:
        """The hot spares asked for (``driver.hot_spares``), per gang, as an event (their
        resources are the run's too); said on the terminal when the job has no gang to keep them."""
        if not self.config.hot_spares:
            return
        spared = {name: {"spares": g.spares, "resources": dict(g.role.resources), "markets": g.spare_markets()}
                  for name, g in groups.all().items() if getattr(g, "spares", 0)}
        reason = "" if spared else ("this job has no gang (its pools replace a lost actor without stopping the step; "
                                    "a trainer in a pool of one is replaced, not taken over), so driver.hot_spares has no effect")
        if reason:
            _say(f"driver.hot_spares={self.config.hot_spares}: {reason}")
        runlog.event("hot_spares", asked=self.config.hot_spares, roles=spared, **({"reason": reason} if reason else {}))

    def _rebuild(self, exc: BaseException) -> None:
        """The groups re-formed (what the workload itself rebuilds first) and the newest checkpoint loaded."""
        assert self._ctx is not None and self._ckpt is not None
        ctx = self._ctx
        # No call of the failed step may run after the rollback (on a replacement above all):
        # it would change the state the checkpoint is about to restore.
        t0 = time.monotonic()
        ctx.groups.abandon()
        self._refresh_cluster()
        self.workload.recover(ctx, exc)
        ctx.groups.reform()
        t1 = time.monotonic()
        latest, state, _ = self._ckpt.newest()
        t2 = time.monotonic()
        if latest is not None:
            rolled_back = self.steps_done - latest.step
            self._load(latest.step, state)
            # Where the recovery's seconds went: re-forming the groups (replacements started),
            # finding the state's sources, loading it into the actors.
            self.log.event("restored", step=latest.step, source="memory" if latest.path == "memory" else "store", steps_rolled_back=rolled_back,
                           reform_s=round(t1 - t0, 3), find_s=round(t2 - t1, 3), load_s=round(time.monotonic() - t2, 3))
        ctx.groups.restored()

    def summary(self, error: BaseException | None) -> dict[str, Any]:
        return {
            "run": self.run_name, "job": self.workload.name, "state": self.state.value, "steps": self.steps_done,
            "wall_time_s": round(time.time() - self.started_at, 3), "final_metrics": self.last_metrics,
            "resumed_from": self.resumed_from, "failures_recovered": self._recovery.recovered, "checkpoints_written": self.checkpoints_written,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "stop_reason": self.stop_reason if self.state is State.STOPPED else None, "run_dir": str(self.run_dir),
            "end_reason": self.end_reason, **({"best": self._best_summary()} if self._best is not None else {}),
        }

    def _best_summary(self) -> dict[str, Any]:
        """The best evaluation and, with ``keep_best``, the checkpoint kept for it."""
        assert self._best is not None
        out = self._best.summary()
        if self.best_kept is not None:
            out["kept"] = {k: self.best_kept[k] for k in ("step", "value", "path")}
        return out


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Closing a run must not hide how it ended."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        log.warning("%s failed while the run closed: %s", getattr(fn, "__qualname__", fn), exc)


def _lost_ranks(lost: dict[str, list[int]], why: str) -> GroupLost:
    """A recoverable loss of the ranks ``lost`` ({role: ranks}); the failure event names the first role."""
    ranks = [r for rs in lost.values() for r in rs]
    err = GroupLost(why, ranks=ranks, actor=",".join(map(str, ranks)))
    err.role = next(iter(lost))  # type: ignore[attr-defined] - the failure event's role
    return err

