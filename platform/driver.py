"""The driver: an explicit state machine that runs one workload to the end.

::

    INITIALIZING -> RUNNING -> (RECOVERING -> RUNNING)* -> FINISHED | FAILED

INITIALIZING snapshots the cluster, plans the workload's roles, lets the workload
build its pools, and resumes from the run's latest checkpoint if there is one.
RUNNING calls ``workload.step`` and, between steps, logs metrics, reacts to node
events (a preemption notice for a node that holds stateful actors triggers a
checkpoint at once), checkpoints by policy, and resizes elastic pools by policy.
RECOVERING is entered when a step raises: the failure policy decides between giving
up (FAILED, with the grouped errors) and recovering (the workload rebuilds what it
lost and reloads the latest checkpoint).

A workload implements :class:`Workload`; the driver never imports a workload.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from raylane.checkpoint import CheckpointStore, CheckpointWriteError
from raylane.cluster import ClusterView
from raylane.elastic import Elasticity
from raylane.placement import plan_when_free
from raylane.plots import plot_run
from raylane.policies import CheckpointPolicy, CheckpointStatus, Failure, FailurePolicy, ScalingPolicy, non_finite
from raylane.preemption import NodeJoined, NodeLeaving, NodeLost, PreemptionMonitor
from raylane.runlock import RunBusy, RunLock
from raylane.runlog import Progress, RunLog
from raylane.runlog import say as _say
from raylane.runpaths import check_run_name
from raylane.signals import SignalTap
from raylane.workload import (  # noqa: F401 - the contract's names are also raylane.driver's
    BaseWorkload, Context, DriverConfig, DriverError, NonFiniteError, RayGone, RunAborted, Workload, default_run_name, hook, is_recoverable,
)

log = logging.getLogger(__name__)

# A node under notice is treated as leaving until it is lost, or this long after its
# deadline (or after the notice, when it gave none).
LEAVING_GRACE_S = 120.0


class State(enum.Enum):
    INITIALIZING = "initializing"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"


# The transitions the driver may make; anything else is a bug in the driver.
TRANSITIONS = {
    State.INITIALIZING: {State.RUNNING, State.FAILED},
    State.RUNNING: {State.RUNNING, State.RECOVERING, State.FINISHED, State.STOPPED, State.FAILED},
    State.RECOVERING: {State.RUNNING, State.FAILED},
    State.FINISHED: set(),
    State.STOPPED: set(),
    State.FAILED: set(),
}


class Driver:
    """Runs ``workload`` under ``config``; :meth:`run` returns the summary dict."""

    def __init__(
        self,
        workload: Workload,
        config: DriverConfig,
        *,
        failure_policy: FailurePolicy | None = None,
        scaling_policy: ScalingPolicy | None = None,
        poll_events: bool = True,
        cluster_source: Callable[[], ClusterView] | None = None,
        event_source: Any = None,
        observer: Any = None,
    ):
        """``cluster_source`` gives cluster snapshots and ``event_source`` (an object with
        ``poll() -> list[Event]``) node events; by default both read Ray. Tests of the
        state machine pass their own to run without Ray. ``observer`` (``checkpointed(step,
        path)``, ``stepped(step, metrics)``) hears of each checkpoint and step; a Tune trial reports through it."""
        self._observer = observer
        self.workload = workload
        self._cluster_source = cluster_source or ClusterView.from_ray
        self.config = config
        self.run_name = check_run_name(config.run_name or default_run_name(workload.name), "driver.run_name")
        self.run_dir = Path(config.runs_dir) / self.run_name
        self.failure_policy = failure_policy or FailurePolicy(max_failures=config.max_failures, max_recovery_s=config.max_recovery_s)
        self.checkpoint_policy = CheckpointPolicy(config.checkpoint_every_steps, config.checkpoint_every_s)
        self.scaling_policy = scaling_policy or ScalingPolicy(grow=config.autoscale)
        self.poll_events = poll_events
        self.state = State.INITIALIZING
        self.history: list[tuple[float, State]] = [(time.time(), State.INITIALIZING)]
        self.step = 0
        self.failures: list[Failure] = []
        self.checkpoints_written = 0
        self.recoveries = 0
        self.resumed_from: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self._last_ckpt_step: int | None = None
        self._last_ckpt_time = time.time()
        self._ctx: Context | None = None
        self._monitor: Any = event_source
        self._leaving: dict[str, float] = {}  # node id -> deadline of its preemption notice
        self._elastic = Elasticity(workload, autoscale=config.autoscale, pool_autoscale=config.pool_autoscale,
                                   scaling_policy=self.scaling_policy, cluster_source=self._cluster_source, run_name=self.run_name)
        self._stop_reason: str | None = None
        self._signals: SignalTap | None = None
        self._started_running = False
        self._started_at = time.time()
        self._evictions_seen: dict[str, float] = {}  # role -> time of the last eviction logged

    # ------------------------------------------------------------ state machine

    def _to(self, new: State, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"driver bug: transition {self.state.name} -> {new.name} is not allowed")
        if new is not self.state:
            log.info("driver: %s -> %s %s", self.state.name, new.name, why)
            if self._ctx is not None:
                self._ctx.log.event("state", state=new.value, reason=why, step=self.step)
        self.state = new
        self._started_running = self._started_running or new is State.RUNNING
        self.history.append((time.time(), new))

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary: checkpoint, end-of-run hook, STOPPED (any thread, or a signal handler)."""
        self._stop_reason = reason

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.request_stop("SIGTERM (the job was stopped)")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_reason is not None:  # the second Ctrl-C: the user will not wait
            _say("second Ctrl-C: aborting now, without a checkpoint of the step under way")
            raise KeyboardInterrupt("second Ctrl-C")
        _say("Ctrl-C: stopping at the end of this step with a checkpoint (Ctrl-C again aborts at once)")
        self.request_stop("SIGINT (Ctrl-C)")

    def run(self) -> dict[str, Any]:
        # `raylane stop` / `ray job stop` send SIGTERM and Ctrl-C sends SIGINT: both end at
        # the next step boundary with a checkpoint instead of dying mid-step (Ray sends
        # SIGKILL a few seconds after SIGTERM; a second Ctrl-C aborts at once).
        try:
            lock = RunLock(self.run_dir)
            lock.acquire()  # before anything is read or written in the run folder
        except RunBusy as exc:
            raise DriverError(str(exc)) from None
        try:
            with SignalTap({signal.SIGTERM: self._on_sigterm, signal.SIGINT: self._on_sigint}) as self._signals:
                return self._run(lock.took_over)
        finally:
            lock.release()

    def _on_ray_gone(self, why: str, started: float, runlog: RunLog) -> None:
        """The embedded Ray died under the driver (a signal to the whole process group
        reaches it too): nothing more can be saved, and every Ray call would wait out the
        core worker's 60 s reconnect. Say so, leave the summary, and end the process now."""
        if self._stop_reason is None and self._signals is not None:
            # the signal that killed Ray reached this process too, but its handler waits for
            # the main thread, which may be blocked in a Ray call: read it from the wakeup pipe
            self._stop_reason = self._signals.stop_reason(wait_s=1.0)
        state = State.STOPPED if self._stop_reason else State.FAILED
        reason = (f"{why}: the Ray this run started was stopped under it (a signal sent to the whole process group "
                  f"stops it too; send it to the raylane process alone to stop at a step boundary). {self._ckpt_hint()}")
        self.state = state
        runlog.event("state", state=state.value, reason=reason, step=self.step)
        runlog.summary(self._summary(started, RayGone(reason)))
        _say(f"run {self.run_name!r} {state.value} at step {self.step}: {reason}")
        os._exit(143 if self._stop_reason else 1)

    def _run(self, took_over: str | None = None) -> dict[str, Any]:
        from raylane import session

        started = time.time()
        runlog = RunLog(self.run_dir, tensorboard=self.config.tensorboard)
        if took_over:
            _say(took_over)
            runlog.event("run_lock_taken_over", reason=took_over)
        unwatch = session.watch_embedded(lambda why: self._on_ray_gone(why, started, runlog),
                                         signalled=lambda: self._signals is not None and self._signals.stop_reason() is not None)
        store = CheckpointStore(self.config.store_uri(self.run_dir), keep=self.config.keep_checkpoints)
        shown = tuple(getattr(self.workload, "progress_metrics", None) or (self.workload.main_metric,))
        progress = Progress(self.config.progress, shown, self.workload.name)
        error: BaseException | None = None
        try:
            self._initialize(runlog, store)
            self._to(State.RUNNING, "initialized")
            progress.begin(self.step)
            while self.state is State.RUNNING:
                try:
                    if self._stop_reason:
                        self._checkpoint(force=f"stop requested: {self._stop_reason}")
                        self._finish()
                        self._to(State.STOPPED, self._stop_reason)
                        break
                    if self._should_stop(started):
                        self._checkpoint(final=True)
                        self._finish()
                        self._to(State.FINISHED, "stop condition reached")
                        break
                    metrics = self.workload.step(self.step)
                    self._check_finite(metrics)
                    self.step += 1
                    self.last_metrics = metrics
                    runlog.metrics(self.step, {**metrics, **self._elastic.pool_sizes()})
                    progress.update(self.step, metrics, self._measures(started, metrics))
                    notice = self._handle_events()
                    self._log_evictions()
                    self._elastic.settle()
                    self._elastic.control(self.step)
                    self._checkpoint(notice=notice)
                    if self.workload.done(self.step, metrics):
                        self._checkpoint(final=True)
                        self._finish()
                        self._to(State.FINISHED, "workload reached its target")
                    if self._observer is not None:
                        self._observer.stepped(self.step, metrics)
                except (NonFiniteError, DriverError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # noqa: BLE001 - every other failure goes through the policy
                    self._recover(exc)
        except BaseException as exc:
            error = exc
            if isinstance(exc, KeyboardInterrupt) and self.state is State.RUNNING:
                self._to(State.STOPPED, "aborted by a second Ctrl-C; the step under way was not kept")
            elif self.state not in (State.FINISHED, State.STOPPED, State.FAILED):
                self._to(State.FAILED, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            unwatch()
            progress.close()
            self._elastic.close(self.state.value)
            summary = self._summary(started, error)
            if self._started_running or not (self.run_dir / "summary.json").exists():
                runlog.summary(summary)
                if self._started_running:  # never raises: a plot must not change how the run ended
                    plot_run(self.run_dir, self.workload.main_metric)
            else:  # a run that could not start keeps the summary of the run it was to continue
                runlog.event("start_failed", error=summary["error"])
            try:
                runlog.close()
            except OSError as exc:  # the last lines could not be flushed (a full disk): the summary says how the run ended
                log.warning("run log not closed cleanly: %s", exc)
            try:
                self.workload.close()
            except Exception as exc:  # noqa: BLE001 - closing must not hide the run's result
                log.warning("workload close failed: %s", exc)
        if error is not None:
            if isinstance(error, DriverError):
                raise error
            if isinstance(error, KeyboardInterrupt):
                raise RunAborted(f"run {self.run_name!r} aborted at step {self.step} (Ctrl-C twice). {self._ckpt_hint()} "
                                 "Run again with the same run name to continue from it.") from error
            raise DriverError(f"run {self.run_name!r} failed at step {self.step}: {error}\n{self._ckpt_hint()}") from error
        return summary

    # ------------------------------------------------------------ phases

    def _initialize(self, runlog: RunLog, store: CheckpointStore) -> None:
        roles = self.workload.roles()

        def waiting(exc: Exception) -> None:
            _say(f"waiting up to {self.config.placement_wait_s:g} s for busy capacity to free: {str(exc).splitlines()[0]}")
            runlog.event("placement_wait", wait_s=self.config.placement_wait_s, error=str(exc))

        cluster, the_plan = plan_when_free(roles, self._cluster_source, self.config.placement_wait_s, waiting)
        self._ctx = Context(cluster, the_plan, store, self.run_dir, runlog)
        runlog.event("plan", assignments=[a.__dict__ for a in the_plan.assignments])
        short = self._elastic.report_shortfalls(roles, the_plan, runlog)
        self.workload.setup(self._ctx)
        self._elastic.keep_asks(short)
        if self.poll_events and self._monitor is None:
            self._monitor = PreemptionMonitor()
        self._elastic.start(self._ctx, self.step, control=self.config.control)
        if not self.config.resume and store.steps():
            raise DriverError(
                f"run {self.run_name!r} already has checkpoints (steps {store.steps()}) in {store.uri}; "
                "set driver.resume=true to continue it, or choose another run name to start over"
            )
        latest, state, skipped = self._newest_checkpoint() if self.config.resume else (None, None, [])
        if latest is not None:
            self._load(latest.step, state)
            self.resumed_from = latest.step
            # The values the run had at that step: a run resumed where it already ends keeps them in its summary.
            self.last_metrics = runlog.last_metrics(latest.step)
            runlog.event("resume", step=latest.step, path=latest.path)
            _say(f"resuming run {self.run_name!r} from step {latest.step} (checkpoint {latest.path})")
        else:
            if skipped:
                runlog.event("resume_none", skipped=len(skipped), reason="no checkpoint of this run loads; starting from step 0")
                _say(f"run {self.run_name!r} has no checkpoint that loads ({len(skipped)} skipped, see above); starting from step 0")
            runlog.rewind(0, "no checkpoint to resume from: the run starts over")  # rows of an earlier start leave
            # The initial state, so that a failure before the first periodic checkpoint
            # still has something consistent to recover to.
            self._checkpoint(force="initial state")

    def _newest_checkpoint(self) -> tuple[Any, dict | None, list[str]]:
        """The newest checkpoint that loads; each one skipped on the way is an event."""
        assert self._ctx is not None
        latest, state, skipped = self._ctx.store.newest()
        for why in skipped:
            self._ctx.log.event("checkpoint_skipped", reason=why)
        return latest, state, skipped

    def _load(self, step: int, state: dict) -> None:
        self.workload.load_state_dict(state["workload"])
        if self._ctx is not None:  # steps past the checkpoint run again: their first values leave metrics.jsonl
            self._ctx.log.rewind(step, f"replayed from the checkpoint of step {step}")
        self.step = step
        self._last_ckpt_step = step
        self._last_ckpt_time = time.time()

    def _finish(self) -> None:
        """The workload's optional end-of-run hook (final model files, plots)."""
        if self._ctx is not None:
            hook(self.workload, "finish")(self._ctx)

    def _should_stop(self, started: float) -> bool:
        if self.step >= self.config.max_steps:
            return True
        return bool(self.config.max_wall_s) and time.time() - started >= self.config.max_wall_s

    def _check_finite(self, metrics: dict[str, Any]) -> None:
        # The main metric is guarded too: a run whose headline number is NaN has not "finished".
        guarded = tuple(dict.fromkeys((*self.workload.guarded_metrics, self.workload.main_metric)))
        if (bad := non_finite(metrics, guarded)) is not None:
            raise NonFiniteError(f"metric {bad[0]!r} is {bad[1]} at step {self.step + 1}; the step's update was not checkpointed. "
                                 f"{self._ckpt_hint()} Lower the learning rate or check the inputs, then run again with the same run name.")

    def _measures(self, started: float, metrics: dict[str, Any]) -> list[tuple[float, float, str]]:
        """How far the run is toward each rule that can stop it, as (done, total, unit)."""
        out = [(float(self.step), float(self.config.max_steps), "steps")] + ([(time.time() - started, self.config.max_wall_s, "s")] if self.config.max_wall_s else [])
        try:
            if (m := hook(self.workload, "progress_of")(self.step, metrics)) is not None:
                out.append((float(m[0]), float(m[1]), str(m[2])))
        except Exception as exc:  # noqa: BLE001 - a progress figure must never fail the run
            log.debug("workload progress_of failed: %s", exc)
        return out

    def _ckpt_hint(self) -> str:
        return "No checkpoint was written." if self._ctx is None else self._ctx.store.hint()

    def _checkpoint(self, *, notice: bool = False, final: bool = False, force: str = "") -> None:
        assert self._ctx is not None
        status = CheckpointStatus(self.step, self._last_ckpt_step, self._last_ckpt_time, time.time(), notice=notice, final=final)
        save, why = (True, force) if force else self.checkpoint_policy.decide(status)
        if not save:
            return
        t0 = time.time()
        state = {"workload": self.workload.state_dict(), "driver": {"step": self.step, "run": self.run_name}}
        try:
            info = self._ctx.store.save(self.step, state)
        except CheckpointWriteError as exc:  # no retry heals a full disk: the run ends here, saying why
            raise DriverError(f"run {self.run_name!r} stopped at step {self.step}: {exc}. {self._ckpt_hint()}") from exc
        self._last_ckpt_step, self._last_ckpt_time = self.step, time.time()
        self.checkpoints_written += 1
        self._ctx.log.event("checkpoint", step=self.step, reason=why, seconds=time.time() - t0)
        if self._observer is not None:
            self._observer.checkpointed(self.step, info.path)

    def _recover(self, exc: BaseException) -> None:
        """RECOVERING: let the failure policy decide; rebuild and reload until it works or
        the policy gives up (a failure while recovering counts as another failure)."""
        assert self._ctx is not None
        self._to(State.RECOVERING, f"{type(exc).__name__} at step {self.step}")
        since: float | None = None  # None for the failure that starts this recovery
        while True:
            role = getattr(exc, "role", None) or "workload"
            self.failures.append(Failure(role, getattr(exc, "actor", "?"), f"{type(exc).__name__}: {exc}", self.step, time.time()))
            decision = self.failure_policy.decide(self.failures, recoverable=is_recoverable(exc), recovering_since=since)
            since = self.failures[-1].at if since is None else since
            self._ctx.log.event("failure", step=self.step, role=role, actor=getattr(exc, "actor", None), error=str(exc)[:2000],
                                decision=decision.action, reason=decision.reason)
            if decision.action == "fail":
                self._to(State.FAILED, decision.reason)
                raise DriverError(f"run {self.run_name!r} failed at step {self.step}: {decision.reason}\n{self._ckpt_hint()}") from exc
            try:
                # No call of the failed step may run after the rollback (on a replacement
                # above all): it would change the state the checkpoint is about to restore.
                for pool in self.workload.pools().values():
                    pool.abandon()
                self._ctx.cluster = self._cluster_source()
                self.workload.recover(self._ctx, exc)
                latest, state, _ = self._newest_checkpoint()
                if latest is not None:
                    self._load(latest.step, state)
                for pool in self.workload.pools().values():
                    pool.restored()
                break
            except Exception as again:  # noqa: BLE001 - judged by the policy on the next turn
                exc = again
        self.recoveries += 1
        self._to(State.RUNNING, f"recovered from step {self.step}")

    def _handle_events(self) -> bool:
        """React to node events; True when a checkpoint is due now: a node with stateful
        actors got a notice, or such actors are still on a node that is leaving."""
        if self._monitor is None or self._ctx is None:
            return False
        events = self._monitor.poll()
        if not events:
            return self._stateful_on_leaving()
        pools = self.workload.pools()
        notice = False
        stateful_roles = {r.name for r in self.workload.roles() if r.stateful}
        for ev in events:
            self._ctx.log.event(type(ev).__name__, node=ev.node_id, market=ev.market, deadline=getattr(ev, "deadline", None))
            if isinstance(ev, NodeLeaving):  # stateless actors move now; stateful ones are the workload's (on_event)
                self._leaving[ev.node_id] = ev.deadline if ev.deadline is not None else time.time()
                for name, pool in pools.items():
                    if name not in stateful_roles and pool.status().nodes.get(ev.node_id, 0):
                        pool.evacuate(ev.node_id, "preemption notice")
            if isinstance(ev, NodeLost):
                self._leaving.pop(ev.node_id, None)
                for pool in pools.values():
                    if pool.status().nodes.get(ev.node_id, 0):
                        pool.evacuate(ev.node_id, "node lost")
            try:
                notice = bool(hook(self.workload, "on_event")(ev)) or notice
            except Exception as exc:  # noqa: BLE001 - a reaction that failed must not drop the other events
                log.warning("workload's on_event(%s) failed: %s", type(ev).__name__, exc)
                self._ctx.log.event("on_event_failed", node=ev.node_id, error=str(exc)[:500])
                notice = True
            if isinstance(ev, NodeLeaving) and any(pool.status().nodes.get(ev.node_id, 0) for name, pool in pools.items() if name in stateful_roles):
                notice = True  # stateful actors the workload did not move: checkpoint now; they are replaced on recovery
        self._ctx.cluster = self._cluster_source()
        if any(isinstance(e, (NodeJoined, NodeLost)) for e in events):
            self._elastic.rescale(pools)
        return self._stateful_on_leaving() or notice

    def _log_evictions(self) -> None:
        """Every actor that left a pool since the last step is an event with its node and
        cause (a lost rollout worker or sampler costs only time, but it must be visible)."""
        assert self._ctx is not None
        for role, pool in self.workload.pools().items():
            seen = self._evictions_seen.get(role, self._started_at)
            for e in pool.status().evictions:
                if e.at > seen:
                    self._ctx.log.event("eviction", role=role, actor=e.actor, node=e.node_id, reason=e.reason, at=e.at, step=self.step)
                    self._evictions_seen[role] = max(self._evictions_seen.get(role, seen), e.at)

    def _stateful_on_leaving(self) -> bool:
        """Stateful actors still on a node under notice (the workload did not hand their
        state over): checkpoint after every step until the node is gone, so its loss costs
        at most the step under way rather than every step since the notice."""
        now = time.time()
        for node, deadline in list(self._leaving.items()):
            if now > deadline + LEAVING_GRACE_S:  # the node outlived its notice by far: stop treating it as leaving
                del self._leaving[node]
        if not self._leaving:
            return False
        stateful = {r.name for r in self.workload.roles() if r.stateful}
        return any(pool.status().nodes.get(node, 0) for name, pool in self.workload.pools().items() if name in stateful for node in self._leaving)

    def _summary(self, started: float, error: BaseException | None) -> dict[str, Any]:
        return {
            "run": self.run_name,
            "job": self.workload.name,
            "state": self.state.value,
            "steps": self.step,
            "wall_time_s": round(time.time() - started, 3),
            "final_metrics": self.last_metrics,
            "resumed_from": self.resumed_from,
            "failures_recovered": self.recoveries,
            "checkpoints_written": self.checkpoints_written,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "stop_reason": self._stop_reason if self.state is State.STOPPED else None,
            "run_dir": str(self.run_dir),
        }

