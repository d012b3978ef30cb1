"""What wraps a driver in a user's process: stop signals, the embedded-Ray watchdog, the
progress bar and the end-of-run plot. None of them changes what a run computes; a Tune
trial or a test steps a driver without them.

A watcher hears of the run's phases (:class:`Watcher`); :func:`default_watchers` are the
ones ``raylane run``, ``python -m raylane.jobs.X`` and ``raylane.api.run_workload`` use.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from raylane.plots import plot_run
from raylane.runlog import Progress, say
from raylane.signals import SignalTap
from raylane.workload import DriverConfig, RayGone

# A watcher is handed the raylane.driver.Driver it wraps and each raylane.run_state.Stepped;
# typed Any here so that the driver can import this module.
Driver = Stepped = Any

log = logging.getLogger(__name__)


class Watcher:
    """Hooks a driver calls; each is a no-op here."""

    def opened(self, driver: Driver) -> None:
        """The run folder is locked and its log open; the run is about to initialize."""

    def running(self, driver: Driver) -> None:
        """Initialized (resumed, or from step 0): steps begin."""

    def stepped(self, driver: Driver, result: Stepped) -> None:
        """One :meth:`Driver.step` call returned."""

    def ended(self, driver: Driver) -> None:
        """The run is over; its summary is about to be written (stop watching here)."""

    def closed(self, driver: Driver, summary: dict[str, Any]) -> None:
        """The summary is written."""


class StopSignals(Watcher):
    """SIGTERM (``raylane stop``, ``ray job stop``) and Ctrl-C end the run at the next step
    boundary with a checkpoint instead of mid-step (Ray sends SIGKILL a few seconds after
    SIGTERM); a second Ctrl-C aborts at once. While the run lasts, a watchdog ends the
    process when the Ray it started dies under it (see :meth:`ray_gone`)."""

    def __init__(self) -> None:
        self.tap: SignalTap | None = None
        self._unwatch: Any = None
        self._driver: Any = None

    def opened(self, driver: Driver) -> None:
        from raylane import session

        self._driver = driver
        self.tap = SignalTap({signal.SIGTERM: self._on_sigterm, signal.SIGINT: self._on_sigint}).__enter__()
        self._unwatch = session.watch_embedded(self.ray_gone, signalled=lambda: self.tap is not None and self.tap.stop_reason() is not None)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._driver.request_stop("SIGTERM (the job was stopped)")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._driver.stop_reason is not None:  # the second Ctrl-C: the user will not wait
            say("second Ctrl-C: aborting now, without a checkpoint of the step under way")
            raise KeyboardInterrupt("second Ctrl-C")
        say("Ctrl-C: stopping at the end of this step with a checkpoint (Ctrl-C again aborts at once)")
        self._driver.request_stop("SIGINT (Ctrl-C)")

    def ray_gone(self, why: str) -> None:
        """The embedded Ray died under the driver (a signal to the whole process group
        reaches it too): nothing more can be saved, and every Ray call would wait out the
        core worker's 60 s reconnect. Say so, leave the summary, and end the process now."""
        d = self._driver
        if d.stop_reason is None and self.tap is not None:
            # the signal that killed Ray reached this process too, but its handler waits for
            # the main thread, which may be blocked in a Ray call: read it from the wakeup pipe
            d.stop_reason = self.tap.stop_reason(wait_s=1.0)
        state = "stopped" if d.stop_reason else "failed"
        reason = (f"{why}: the Ray this run started was stopped under it (a signal sent to the whole process group "
                  f"stops it too; send it to the raylane process alone to stop at a step boundary). {d.checkpoint_hint()}")
        d.mark_ended(state, reason)
        d.log.summary(d.summary(RayGone(reason)))
        say(f"run {d.run_name!r} {state} at step {d.steps_done}: {reason}")
        os._exit(143 if d.stop_reason else 1)

    def ended(self, driver: Driver) -> None:
        if self._unwatch is not None:
            self._unwatch()

    def closed(self, driver: Driver, summary: dict[str, Any]) -> None:
        if self.tap is not None:
            self.tap.__exit__(None, None, None)
            self.tap = None


class ProgressBar(Watcher):
    """A live bar toward the stop rule that ends the run first, with the main metrics."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Progress | None = None

    def opened(self, driver: Driver) -> None:
        w = driver.workload
        self.bar = Progress(self.enabled, tuple(w.progress_metrics or (w.main_metric,)), w.name)

    def running(self, driver: Driver) -> None:
        if self.bar is not None:
            self.bar.begin(driver.steps_done)

    def stepped(self, driver: Driver, result: Stepped) -> None:
        if self.bar is not None and result.metrics:
            self.bar.update(result.step, result.metrics, self.measures(driver, result))

    @staticmethod
    def measures(driver: Driver, result: Stepped) -> list[tuple[float, float, str]]:
        """How far the run is toward each rule that can stop it, as (done, total, unit)."""
        c = driver.config
        out = [(float(result.step), float(c.max_steps), "steps")]
        if c.max_wall_s:
            out.append((time.time() - driver.started_at, c.max_wall_s, "s"))
        try:
            if (m := driver.workload.progress_of(result.step, result.metrics)) is not None:
                out.append((float(m[0]), float(m[1]), str(m[2])))
        except Exception as exc:  # noqa: BLE001 - a progress figure must never fail the run
            log.debug("workload progress_of failed: %s", exc)
        return out

    def ended(self, driver: Driver) -> None:
        if self.bar is not None:
            self.bar.close()


class RunPlot(Watcher):
    """``<run folder>/<main metric>.png`` once a run that ran has ended (never raises)."""

    def closed(self, driver: Driver, summary: dict[str, Any]) -> None:
        if driver.ran:
            plot_run(driver.run_dir, driver.workload.main_metric)


def default_watchers(config: DriverConfig) -> list[Watcher]:
    """What wraps a run started by a user: stop signals and the Ray watchdog, the progress bar, the plot."""
    return [StopSignals(), ProgressBar(config.progress), RunPlot()]
