"""One run folder, one process: an exclusive lock held for as long as a run writes there.

Two runs under one name would both resume from the checkpoint the other is writing and
interleave their metrics, events and checkpoints. The lock is ``flock`` on
``<run folder>/.lock`` (the kernel drops it when its process dies, so a crash never leaves
the folder locked); the file names the holder (pid, host, start time) for the refusal,
and is emptied on a clean release. A file still naming a holder when the lock is free
is the mark of a process that died holding it: the new run takes over and says so.

The lock is re-entrant within a process (``raylane run`` takes it before it writes the
run's record, and the driver takes it again): a second ``flock`` of the same file from
the same process through another descriptor would wait on itself.

    with RunLock(run_dir) as lock:
        if lock.took_over: print(lock.took_over)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_FILE = ".lock"

_held: dict[str, list] = {}  # resolved folder -> [fd, depth, took_over, made by this lock]
_guard = threading.Lock()


class RunBusy(RuntimeError):
    """Another process holds the run folder; the message names it and what to do."""


class RunLock:
    """The exclusive lock of one run folder (see the module docstring)."""

    def __init__(self, run_dir: Path | str):
        self.dir = Path(run_dir)
        self.took_over: str | None = None  # set when a dead holder's mark was found

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        made = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        key = str(self.dir.resolve())
        with _guard:
            if key in _held:
                _held[key][1] += 1
                self.took_over = _held[key][2]
                return
            fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise RunBusy(f"run folder {self.dir} is in use by {_describe(holder)}: two runs under one name would resume from "
                              "each other's checkpoints and mix their records. Wait for it to end (or stop it), or choose another "
                              "--run-name (--new picks a free one)") from None
            previous = _read(fd)
            if previous:
                self.took_over = (f"run folder {self.dir} was last held by {_describe(previous)}, which ended without releasing it "
                                  "(killed or crashed); this run takes it over")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
            _held[key] = [fd, 1, self.took_over, made]

    def release(self) -> None:
        key = str(self.dir.resolve())
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            fd, made = entry[0], entry[3]
            del _held[key]
            try:
                os.ftruncate(fd, 0)  # a clean end: the next holder finds no mark to take over
                if made and [p.name for p in self.dir.iterdir()] == [LOCK_FILE]:
                    # refused before it wrote anything (a bad input): leave no empty run folder behind
                    (self.dir / LOCK_FILE).unlink()
                    self.dir.rmdir()
            except OSError:
                pass
            finally:
                os.close(fd)  # closing the last descriptor drops the flock


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"pid": "?", "note": "an unreadable lock file"}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"
