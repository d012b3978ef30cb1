"""Which stop signals reached this process, known even before Python runs their handler.

Python runs a signal's handler only when the main thread next executes bytecode; a driver
blocked in a Ray call may not get there before a watchdog thread must decide how the run
ended (a signal to the whole process group kills the embedded Ray at the same instant).
The interpreter's C-level handler writes each signal's number to the wakeup fd at once,
so reading that pipe tells another thread the truth. Standard library only: this is the
documented use of ``signal.set_wakeup_fd``, and no library wraps it better.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any, Callable, Iterable

NAMES = {signal.SIGTERM: "SIGTERM (the job was stopped)", signal.SIGINT: "SIGINT (Ctrl-C)"}


class SignalTap:
    """Installs ``handlers`` (signal -> callable) and a wakeup pipe for the duration of a
    ``with`` block in the main thread; elsewhere it installs nothing and ``seen`` is empty."""

    def __init__(self, handlers: dict[int, Callable[[int, Any], None]]) -> None:
        self._handlers = handlers
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._seen: list[int] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "SignalTap":
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()  # before the handlers: a failure here leaves nothing installed
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._pipe = (r, w)
        except ValueError:  # not the main interpreter: handlers still work, only the early read is lost
            os.close(r)
            os.close(w)
        self._previous = {sig: signal.signal(sig, handler) for sig, handler in self._handlers.items()}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            with self._lock:
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None

    def seen(self, wait_s: float = 0.0, *, among: Iterable[int] | None = None) -> list[int]:
        """Signal numbers that arrived so far, waiting up to ``wait_s`` for one (of ``among``,
        when given: another signal arriving meanwhile does not end the wait)."""
        wanted = None if among is None else set(among)

        def found() -> bool:
            return bool(self._seen) if wanted is None else any(s in wanted for s in self._seen)

        with self._lock:
            if self._pipe is None:
                return list(self._seen)
            r = self._pipe[0]
            deadline = time.monotonic() + wait_s
            while True:
                left = deadline - time.monotonic()
                if not found() and left > 0:
                    select.select([r], [], [], left)
                try:
                    data = os.read(r, 512)
                except BlockingIOError:
                    data = b""
                self._seen.extend(data)
                if found() or time.monotonic() >= deadline:
                    return list(self._seen)

    def stop_reason(self, wait_s: float = 0.0) -> str | None:
        """The reason of the first stop signal seen (waiting up to ``wait_s`` for one), or None."""
        for sig in self.seen(wait_s, among=NAMES):
            if sig in NAMES:
                return NAMES[sig]
        return None
