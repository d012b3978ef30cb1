"""The signal tap: a stop signal is known to other threads before its handler runs."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from raylane.signals import SignalTap

pytestmark = pytest.mark.timeout(30)


def test_a_watcher_thread_learns_of_sigterm_from_the_pipe_and_the_handler_still_runs():
    handled: list[int] = []
    got: list[str | None] = []
    before = signal.getsignal(signal.SIGTERM)
    with SignalTap({signal.SIGTERM: lambda sig, frame: handled.append(sig)}) as tap:
        watcher = threading.Thread(target=lambda: got.append(tap.stop_reason(wait_s=10)))
        watcher.start()
        os.kill(os.getpid(), signal.SIGTERM)
        watcher.join(10)
    assert got == ["SIGTERM (the job was stopped)"]
    assert handled == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before  # restored on leaving


def test_nothing_seen_means_no_stop_reason_after_the_wait():
    with SignalTap({signal.SIGINT: lambda sig, frame: None}) as tap:
        assert tap.stop_reason(wait_s=0.05) is None
        assert tap.seen() == []


def test_off_the_main_thread_it_installs_nothing():
    out: dict[str, object] = {}

    def body() -> None:
        before = signal.getsignal(signal.SIGTERM)
        with SignalTap({signal.SIGTERM: lambda sig, frame: None}) as tap:
            out["same"] = signal.getsignal(signal.SIGTERM) is before
            out["reason"] = tap.stop_reason(wait_s=0.01)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert out == {"same": True, "reason": None}
