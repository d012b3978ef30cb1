"""The signal tap: a stop signal is known to other threads before its handler runs."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from raylane.signals import SignalTap

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


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


def test_another_signal_does_not_end_the_wait_for_a_stop_signal():
    got: list[str | None] = []
    with SignalTap({signal.SIGTERM: lambda s, f: None, signal.SIGUSR1: lambda s, f: None}) as tap:
        watcher = threading.Thread(target=lambda: got.append(tap.stop_reason(wait_s=20)))
        watcher.start()
        os.kill(os.getpid(), signal.SIGUSR1)  # not a stop: the watcher keeps waiting
        watcher.join(0.5)
        assert watcher.is_alive() and got == []
        os.kill(os.getpid(), signal.SIGTERM)
        watcher.join(20)
    assert got == ["SIGTERM (the job was stopped)"]


def test_the_watchdog_ignores_a_ray_helper_that_died_before_the_stop_signal():
    import subprocess
    import sys

    import psutil

    from raylane import session

    procs = {k: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for k in ("gcs", "raylet", "early", "later")}
    try:
        session._EMBEDDED[:] = [("gcs_server", psutil.Process(procs["gcs"].pid)), ("raylet", psutil.Process(procs["raylet"].pid))]
        session._EMBEDDED_AUX[:] = [("dashboard", psutil.Process(procs["early"].pid)), ("log_monitor", psutil.Process(procs["later"].pid))]
        procs["early"].kill()  # a helper gone long before any signal (a dashboard that failed to start)
        procs["early"].wait(10)
        signalled = threading.Event()
        gone: list[str] = []
        unwatch = session.watch_embedded(gone.append, every_s=0.05, signalled=signalled.is_set)
        try:
            signalled.wait(0.3)
            signalled.set()  # a stop signal to this process alone: the dead dashboard must not end the run
            threading.Event().wait(0.5)
            assert gone == []
            procs["later"].kill()  # a helper that ran until the signal ends: the group got it
            procs["later"].wait(10)
            deadline = threading.Event()
            for _ in range(200):
                if gone:
                    break
                deadline.wait(0.05)
            assert gone and "log_monitor" in gone[0], gone
        finally:
            unwatch()
    finally:
        session._EMBEDDED.clear()
        session._EMBEDDED_AUX.clear()
        for p in procs.values():
            p.kill()
            p.wait(10)
