"""Connecting to Ray: an embedded local instance, or an existing cluster.

Embedded means ``ray.init(address="local")``: a private Ray for this process that
never joins another cluster on the machine. It listens on 127.0.0.1 only (GCS, raylet,
workers, agents, metrics), the dashboard too when asked for, and it goes down with the
driver even when the driver is SIGKILLed (a small reaper process, see :mod:`raylane.reaper`).
Ray's token authentication stays as Ray sets it (on, for local starts).

Joining an existing cluster has a deadline (``RAYLANE_CONNECT_TIMEOUT``, 30 s): the
GCS port is probed first, then ``ray.init`` itself is bounded, and either failure ends
in a :class:`ConnectError` that names the address and what to check.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from raylane import reaper
from raylane.join import CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S, ConnectError, connect_timeout_s, join, loopback_node

log = logging.getLogger(__name__)

__all__ = ["CONNECT_TIMEOUT_ENV", "DEFAULT_CONNECT_TIMEOUT_S", "ConnectError", "connect", "connect_timeout_s", "disconnect",
           "embedded_ray_gone", "shutdown_within", "watch_embedded"]


def connect(address: str | None = None, *, num_cpus: int | None = None, dashboard: bool = False, quiet: bool = True,
            timeout_s: float | None = None) -> str:
    """Start or join Ray; returns the GCS address. Does nothing if already connected.

    Joining (any ``address`` but None/""/"local") gives up after ``timeout_s`` (default:
    :func:`connect_timeout_s`) with a :class:`ConnectError`."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict = {"log_to_driver": not quiet, "configure_logging": True, "logging_level": logging.WARNING if quiet else logging.INFO}
    if address in (None, "", "local"):
        kwargs.update(address="local", include_dashboard=dashboard, num_cpus=num_cpus)
        if dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"
        _own_token_file()
        with loopback_node():
            ray.init(**kwargs)
        _remember_embedded()
    else:
        join(address, kwargs, connect_timeout_s(timeout_s))
    from raylane.security import loose_token_warning  # Ray has just settled on its auth mode and token

    if problem := loose_token_warning():
        log.warning(problem)
    return ray.get_runtime_context().gcs_address


def shutdown_within(timeout_s: float) -> bool:
    """``ray.shutdown()``, given up after ``timeout_s``; True when it finished. Either way
    it is not run again at exit (where it could wait out the core worker's 60 s reconnect
    to a Ray that was killed under this process)."""
    import atexit

    import ray

    if not ray.is_initialized():
        return True
    worker = threading.Thread(target=ray.shutdown, name="raylane-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    atexit.unregister(ray.shutdown)
    _EMBEDDED.clear()
    _EMBEDDED_AUX.clear()
    _EMBEDDED_GCS.clear()
    if worker.is_alive():  # the reaper stays: once this process is gone it ends what is left of the embedded Ray
        return False
    reaper.stop()
    return True


def _own_token_file() -> None:
    """Before a local start with token authentication and no token yet: write the token
    file ourselves, readable by its owner only, for Ray to find. Left to Ray, the local
    start writes it readable by everyone (mode 644), and whoever reads it can run code
    on this Ray; every later command would also warn about it."""
    from raylane.security import AUTH_MODE_ENV, SecurityError, create_token_file, default_token_path, find_token

    if os.environ.get(AUTH_MODE_ENV, "").strip().lower() == "disabled":
        return
    try:
        if find_token() is not None:
            return
        create_token_file(default_token_path())
    except (OSError, SecurityError) as exc:  # Ray reports a bad token setting itself
        log.debug("token file not made: %s", exc)


def disconnect() -> None:
    import ray

    _EMBEDDED.clear()
    _EMBEDDED_AUX.clear()
    _EMBEDDED_GCS.clear()
    if ray.is_initialized():
        ray.shutdown()
    reaper.stop()


# The GCS and raylet processes of the Ray this process started itself (empty when it
# joined a cluster): they die with a signal sent to the whole process group (`timeout`,
# a terminal's job control), and a driver calling into a dead Ray would then wait out
# the core worker's 60 s reconnect before the process is ended, writing nothing.
_EMBEDDED: list = []
# Ray's helper processes of that start (log monitor, dashboard, autoscaler monitor). They end
# at once on SIGTERM where the raylet takes ~10 s to shut down, so one of them gone right
# after this process got a stop signal tells that the signal went to the whole group.
_EMBEDDED_AUX: list = []
# The GCS address of that start: a record made for another Ray (this one was shut down with a
# plain ray.shutdown() and another started, as a notebook or a test suite does) is stale.
_EMBEDDED_GCS: list = []


def _remember_embedded() -> None:
    import psutil
    import ray

    try:  # Ray's own record of the processes it started (not a public API: checked, not assumed)
        from ray._private import worker

        _EMBEDDED_GCS[:] = [ray.get_runtime_context().gcs_address]
        procs = worker._global_node.all_processes
        _EMBEDDED[:] = [(kind, psutil.Process(info.process.pid)) for kind in ("gcs_server", "raylet") for info in procs.get(kind, [])]
        _EMBEDDED_AUX[:] = [(kind, psutil.Process(info.process.pid)) for kind in ("log_monitor", "dashboard", "monitor")
                            for info in procs.get(kind, [])]
        roots = [info.process.pid for infos in procs.values() for info in infos]
    except Exception as exc:  # noqa: BLE001 - without the record there is only no watchdog
        log.debug("embedded Ray processes not found (%s); no watchdog", exc)
        _EMBEDDED.clear()
        _EMBEDDED_AUX.clear()
        return
    reaper.start(roots)


def _still_embedded() -> bool:
    """Whether the Ray this process is connected to is the one it started itself (True
    when the start's address was not recorded: nothing says otherwise)."""
    import ray

    if not _EMBEDDED_GCS:
        return True
    try:
        return ray.is_initialized() and [ray.get_runtime_context().gcs_address] == _EMBEDDED_GCS
    except Exception:  # noqa: BLE001 - no context, no embedded Ray to watch
        return False


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def embedded_ray_gone(helpers: list | None = None) -> str | None:
    """Which of the embedded Ray's GCS and raylet (and of ``helpers``, a list of ``(kind,
    process)``) is gone, or None while all run (and when this process did not start its Ray)."""
    for kind, proc in _EMBEDDED + (helpers or []):
        if not _alive(proc):
            return f"the embedded Ray's {kind} (pid {proc.pid}) is gone"
    return None


def watch_embedded(on_gone: Callable[[str], None], every_s: float = 0.5,
                   signalled: Callable[[], bool] = lambda: False) -> Callable[[], None]:
    """Call ``on_gone(reason)`` once, from a daemon thread, when the embedded Ray's GCS or
    raylet dies, or, once ``signalled()`` says this process got a stop signal, when one of
    Ray's helper processes that ran until then died too (the signal reached the whole
    process group, and the raylet is shutting down); returns a function that stops
    watching. A no-op for a joined cluster."""
    stop = threading.Event()
    if _EMBEDDED and not _still_embedded():
        _EMBEDDED.clear()  # a Ray this process started once, shut down since; not the one in use now
        _EMBEDDED_AUX.clear()
        _EMBEDDED_GCS.clear()
    if not _EMBEDDED:
        return stop.set

    def loop() -> None:
        running = list(_EMBEDDED_AUX)  # the helpers alive at the last look taken before any stop signal
        while not stop.wait(every_s):
            # looked at before asking about the signal, so that a look kept is one from before
            # it; a helper that died before the signal (a dashboard that failed to start) says nothing
            alive_now = [(kind, p) for kind, p in _EMBEDDED_AUX if _alive(p)]
            if signalled():
                helpers = running
            else:
                running, helpers = alive_now, None
            if (why := embedded_ray_gone(helpers)) is not None:
                on_gone(why)
                return

    threading.Thread(target=loop, name="raylane-ray-watchdog", daemon=True).start()
    return stop.set
