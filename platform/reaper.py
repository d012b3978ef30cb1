"""The embedded Ray goes down with its driver, even a SIGKILLed one.

Ray starts the GCS, raylet, dashboard, monitor and log monitor with a parent-death
signal, so they die with the driver; but the raylet's children (dashboard agent,
runtime-env agent, workers) only notice their raylet is gone after 60-130 s. The
reaper is a small process in its own session (a signal to the driver's process group
does not reach it) that keeps a list of the embedded Ray's processes and their
descendants, refreshed every second, and ends them all once the driver is gone.
:func:`stop` (a clean ``ray.shutdown``) tells it to leave without doing anything.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

_REAPER: list[subprocess.Popen] = []
_REAPER_CODE = "import sys; from raylane.reaper import main; main(sys.argv[1:])"


def start(roots: list[int]) -> None:
    stop()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _REAPER_CODE, str(os.getpid()), *map(str, roots)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as exc:  # without it, a SIGKILLed driver leaves Ray's agents for a minute or two: said, not fatal
        log.warning("no reaper for the embedded Ray (%s): if this process is killed, Ray's agents may outlive it for ~2 minutes", exc)
        return
    _REAPER.append(proc)


def stop() -> None:
    while _REAPER:
        proc = _REAPER.pop()
        try:
            proc.stdin.write(b"stop\n")
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


def main(argv: list[str]) -> None:
    """The reaper's main: ``argv`` is the driver's pid, then the pids of the processes its
    Ray start spawned. Leaves on "stop" from the driver; otherwise, once the driver is gone
    (EOF on stdin, or its pid dead), SIGTERMs everything it has seen, then SIGKILLs after 3 s."""
    import select
    import signal

    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()

    def process(pid: int) -> psutil.Process | None:
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None

    driver = process(int(argv[0]))
    seen: dict[int, psutil.Process] = {p.pid: p for p in map(process, map(int, argv[1:])) if p is not None}

    def alive(p: psutil.Process | None) -> bool:
        try:
            return p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def refresh() -> None:  # every live descendant of what was seen, from one pass over the process table
        children: dict[int, list[psutil.Process]] = {}
        for p in psutil.process_iter(["ppid"]):
            children.setdefault(p.info["ppid"], []).append(p)
        todo = [pid for pid, p in seen.items() if alive(p)]
        while todo:
            for c in children.get(todo.pop(), []):
                if c.pid not in seen and c.pid not in (me, driver.pid if driver else -1):
                    seen[c.pid] = c
                    todo.append(c.pid)

    while alive(driver):
        refresh()
        if select.select([sys.stdin], [], [], 1.0)[0]:
            line = sys.stdin.buffer.readline()
            if line.strip() == b"stop":
                return
            if not line:  # EOF: the driver's end of the pipe is closed, so the driver is gone
                break
    refresh()
    victims = [p for p in seen.values() if alive(p)]
    for p in victims:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(victims, timeout=3)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
