"""The states of a run, the transitions the driver may make between them, and what one
step reports. Pure data: the driver (:mod:`raylane.driver`) moves through them.

::

    INITIALIZING -> RUNNING -> (RECOVERING -> RUNNING)* -> FINISHED | STOPPED | FAILED
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from raylane.runlog import RunLog
from raylane.workload import DriverError, RunAborted

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Stepped:
    """What one :meth:`Driver.step` call did."""

    state: State
    """The driver's state after the call: RUNNING while more steps follow."""
    step: int
    """Steps done so far (the step just run is this number)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The step's metrics; empty when no step ran (a stop rule ended the run, or a failure was recovered)."""
    checkpoint: tuple[int, str] | None = None
    """(step, path) of the newest checkpoint written during the call, if any."""
    recovered: bool = False
    """The step failed and the run was rolled back to its newest checkpoint."""



class StateMachine:
    """A run's state, the way it got there and how it ended; the driver is one."""

    def __init__(self) -> None:
        self.state = State.INITIALIZING
        self.history: list[tuple[float, State]] = [(time.time(), State.INITIALIZING)]
        self.steps_done = 0
        self.ran = False  # reached RUNNING
        self.log: RunLog | None = None
        self._error: BaseException | None = None

    def to(self, new: State, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"driver bug: transition {self.state.name} -> {new.name} is not allowed")
        if new is not self.state:
            log.info("driver: %s -> %s %s", self.state.name, new.name, why)
            if self.log is not None:
                self.log.event("state", state=new.value, reason=why, step=self.steps_done)
        self.state = new
        self.ran = self.ran or new is State.RUNNING
        self.history.append((time.time(), new))

    def mark_ended(self, state: str, reason: str) -> None:
        """The run ended outside the state machine (its Ray died under it): record it as ``state``."""
        self.state = State(state)
        if self.log is not None:
            self.log.event("state", state=state, reason=reason, step=self.steps_done)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Any exception leaving the block ends the run (:meth:`failed`) and is raised on."""
        try:
            yield
        except BaseException as exc:
            self.failed(exc)
            raise

    def failed(self, exc: BaseException) -> None:
        """The run ends on ``exc``: STOPPED on a second Ctrl-C, FAILED otherwise (unless it already ended)."""
        self._error = self._error or exc
        if isinstance(exc, KeyboardInterrupt) and self.state is State.RUNNING:
            self.to(State.STOPPED, "aborted by a second Ctrl-C; the step under way was not kept")
        elif self.state not in (State.FINISHED, State.STOPPED, State.FAILED):
            self.to(State.FAILED, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

    def outcome(self, error: BaseException, run_name: str, hint: str) -> BaseException:
        """What the caller of a failed run gets: the driver's own errors as they are, a second Ctrl-C as
        :class:`RunAborted`, anything else as a :class:`DriverError` naming the run, the step and the checkpoint."""
        if isinstance(error, DriverError):
            return error
        if isinstance(error, KeyboardInterrupt):
            out: DriverError = RunAborted(f"run {run_name!r} aborted at step {self.steps_done} (Ctrl-C twice). {hint} "
                                          "Run again with the same run name to continue from it.")
        else:
            out = DriverError(f"run {run_name!r} failed at step {self.steps_done}: {error}\n{hint}")
        out.__cause__ = error
        return out
