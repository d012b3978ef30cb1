"""Connecting to Ray: an embedded local instance, or an existing cluster.

Embedded means ``ray.init(address="local")``: a private Ray for this process that
never joins another cluster on the machine. It listens on 127.0.0.1 only (GCS, raylet,
workers, agents, metrics), the dashboard too when asked for, and it goes down with the
driver even when the driver is SIGKILLed (a small reaper process, see :func:`_reap`).
Ray's token authentication stays as Ray sets it (on, for local starts).

Joining an existing cluster has a deadline (``RAYLANE_CONNECT_TIMEOUT``, 30 s): the
GCS port is probed first, then ``ray.init`` itself is bounded, and either failure ends
in a :class:`ConnectError` that names the address and what to check.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_ENV = "RAYLANE_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 30.0


class ConnectError(ConnectionError):
    """Joining a Ray cluster failed or ran past its deadline; the message says what to check.
    After ``stuck`` (``ray.init`` still running in a thread) the process should end with
    ``os._exit``: a normal exit would run Ray's atexit shutdown against the half-made connection."""

    def __init__(self, message: str, stuck: bool = False):
        super().__init__(message)
        self.stuck = stuck


def connect_timeout_s(override: float | None = None) -> float:
    """The connect deadline: ``override``, else ``$RAYLANE_CONNECT_TIMEOUT``, else 30 s."""
    if override is not None:
        return override
    raw = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConnectError(f"{CONNECT_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 30") from None
    if value <= 0:
        raise ConnectError(f"{CONNECT_TIMEOUT_ENV}={raw!r} must be more than 0 seconds; set it to e.g. 30")
    return value


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
        with _loopback_node():
            ray.init(**kwargs)
        _remember_embedded()
    else:
        _join(address, kwargs, connect_timeout_s(timeout_s))
    from raylane.security import loose_token_warning  # Ray has just settled on its auth mode and token

    if problem := loose_token_warning():
        log.warning(problem)
    return ray.get_runtime_context().gcs_address


class _loopback_node:
    """While a local Ray starts: its node IP is 127.0.0.1, so the GCS, raylet, core workers,
    agents and metrics servers bind to loopback instead of every interface. Ray does this
    itself on macOS and Windows (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` unset there); the
    variable is read by every process the local start spawns, and put back afterwards so a
    later join of a real cluster from this process finds its own routable IP."""

    _ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

    def __enter__(self) -> None:
        from ray._private import ray_constants

        self._env, self._const = os.environ.get(self._ENV), ray_constants.ENABLE_RAY_CLUSTER
        os.environ[self._ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False

    def __exit__(self, *exc: object) -> None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = self._const
        if self._env is None:
            os.environ.pop(self._ENV, None)
        else:
            os.environ[self._ENV] = self._env


# What to check when a join fails; the token part mirrors raylane.security.HOW_TO_SUPPLY.
_CHECK = ("check that the Ray head is running there (`ray status` on the head node), that the host and port are the GCS "
          "address (port 6379 unless `ray start --port` said otherwise) and that no firewall is in the way")
_TOKEN = ("with token authentication, pass the cluster's token: export RAY_AUTH_TOKEN=<token>, or RAY_AUTH_TOKEN_PATH=<file>, "
          "or put it in ~/.ray/auth_token (`ray get-auth-token` on the head prints it), and set RAY_AUTH_MODE=token")


def _target(address: str) -> tuple[str, list[tuple[str, int]]]:
    """(the address as shown to the user, the host:port pairs that may answer) for a join.
    "auto" and RAY_ADDRESS are resolved as Ray resolves them; Ray also turns 127.0.0.1 into
    this machine's IP, which an embedded (loopback-only) Ray does not answer on, so a
    loopback address is tried as given as well."""
    from ray._private import services

    if address.startswith("ray://"):
        hostport = shown = address[len("ray://"):].split("/", 1)[0]
        pairs = [_split(hostport, address)]
    else:
        try:
            resolved = services.canonicalize_bootstrap_address(address)
        except Exception as exc:  # noqa: BLE001 - Ray's own parse/lookup error, reworded
            raise ConnectError(f"cannot use Ray address {address!r}: {exc}; pass --address host:port (the head's GCS address)") from None
        if resolved is None:
            raise ConnectError(f"no running Ray cluster found for address {address!r} (RAY_ADDRESS unset and none started on this "
                               "machine); pass --address host:port with the head's GCS address")
        given = os.environ.get("RAY_ADDRESS") or address
        pairs = [_split(resolved, address)]
        shown = resolved if given in ("auto", resolved) else f"{given} (resolved by Ray to {resolved})"
        if ":" in given and _is_loopback(_split(given, address)[0]):
            pairs.append(_split(given, address))
    return shown, list(dict.fromkeys(pairs))


def _split(hostport: str, address: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConnectError(f"Ray address {address!r} is not host:port; pass --address host:port (e.g. 10.0.0.5:6379)")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _probe(pairs: list[tuple[str, int]], deadline: float) -> tuple[tuple[str, int] | None, int, str]:
    """TCP-connect to each pair in turn until one answers or ``deadline``: (the pair that
    answered or None, attempts, last error)."""
    attempts, last = 0, ""
    while True:
        for host, port in pairs:
            attempts += 1
            try:
                with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                    return (host, port), attempts, ""
            except OSError as exc:
                last = f"{host}:{port}: {exc.strerror or exc or type(exc).__name__}"
        if time.monotonic() + 0.5 >= deadline:
            return None, attempts, last
        time.sleep(0.5)


def _join(address: str, kwargs: dict, timeout_s: float) -> None:
    import contextlib

    import ray

    deadline = time.monotonic() + timeout_s
    shown, pairs = _target(address)
    answered, attempts, last_error = _probe(pairs, deadline)
    if answered is None:
        raise ConnectError(f"cannot reach a Ray cluster at {shown}: nothing answered within {timeout_s:g} s ({attempts} TCP "
                           f"connect attempts, last: {last_error}); {_CHECK}. A slow start? Raise {CONNECT_TIMEOUT_ENV} "
                           f"(seconds, now {timeout_s:g}).")
    loopback_only = answered != pairs[0]  # an embedded Ray on this machine: join it on loopback, as it was started
    target = f"{answered[0]}:{answered[1]}" if loopback_only else address
    outcome: dict = {}

    def init() -> None:
        try:
            with _loopback_node() if loopback_only else contextlib.nullcontext():
                ray.init(**{**kwargs, "address": target})
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc

    if threading.current_thread() is threading.main_thread():  # what ray.init does in the main thread, and skips in ours
        from ray._private.utils import set_sigterm_handler

        set_sigterm_handler(lambda signum, frame: sys.exit(signum))
    worker = threading.Thread(target=init, name="raylane-connect", daemon=True)
    quiet = _DropMessage("SIGTERM handler is not set")
    logging.getLogger("ray._private.worker").addFilter(quiet)
    worker.start()
    while worker.is_alive() and time.monotonic() < deadline:  # short joins: signals (Ctrl-C, SIGTERM) still get through
        worker.join(min(0.2, max(0.0, deadline - time.monotonic())))
    logging.getLogger("ray._private.worker").removeFilter(quiet)
    if worker.is_alive():
        raise ConnectError(f"cannot join the Ray cluster at {shown}: the port answers but Ray's handshake did not finish within "
                           f"{timeout_s:g} s; is it a Ray GCS port (not the dashboard's 8265, nor a client server's 10001 "
                           f"without ray://)? {_TOKEN}. A slow cluster? Raise {CONNECT_TIMEOUT_ENV} (seconds).", stuck=True)
    if (exc := outcome.get("error")) is not None:
        text = " ".join(str(e) for e in _chain(exc)).strip()
        if _is_auth(exc, text):
            raise ConnectError(f"cannot authenticate to the Ray cluster at {shown}: {text[:300]}; {_TOKEN}.") from None
        if isinstance(exc, (ConnectionError, RuntimeError, TimeoutError)):
            raise ConnectError(f"cannot join the Ray cluster at {shown}: {text[:300]}; {_CHECK}; {_TOKEN}.") from None
        raise exc


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _is_auth(exc: BaseException, text: str) -> bool:
    from ray.exceptions import AuthenticationError

    lowered = text.lower()
    return (any(isinstance(e, AuthenticationError) for e in _chain(exc))
            or any(w in lowered for w in ("unauthenticated", "auth token", "authentication", "invalid bearer")))


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
    if worker.is_alive():  # the reaper stays: once this process is gone it ends what is left of the embedded Ray
        return False
    _stop_reaper()
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
    if ray.is_initialized():
        ray.shutdown()
    _stop_reaper()


# The GCS and raylet processes of the Ray this process started itself (empty when it
# joined a cluster): they die with a signal sent to the whole process group (`timeout`,
# a terminal's job control), and a driver calling into a dead Ray would then wait out
# the core worker's 60 s reconnect before the process is ended, writing nothing.
_EMBEDDED: list = []


def _remember_embedded() -> None:
    import psutil

    try:  # Ray's own record of the processes it started (not a public API: checked, not assumed)
        from ray._private import worker

        procs = worker._global_node.all_processes
        _EMBEDDED[:] = [(kind, psutil.Process(info.process.pid)) for kind in ("gcs_server", "raylet") for info in procs.get(kind, [])]
        roots = [info.process.pid for infos in procs.values() for info in infos]
    except Exception as exc:  # noqa: BLE001 - without the record there is only no watchdog
        log.debug("embedded Ray processes not found (%s); no watchdog", exc)
        _EMBEDDED.clear()
        return
    _start_reaper(roots)


def embedded_ray_gone() -> str | None:
    """Which of the embedded Ray's GCS and raylet is gone, or None while both run (and
    when this process did not start its Ray)."""
    import psutil

    for kind, proc in _EMBEDDED:
        try:
            alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            return f"the embedded Ray's {kind} (pid {proc.pid}) is gone"
    return None


def watch_embedded(on_gone: Callable[[str], None], every_s: float = 0.5) -> Callable[[], None]:
    """Call ``on_gone(reason)`` once, from a daemon thread, when the embedded Ray's GCS or
    raylet dies; returns a function that stops watching. A no-op for a joined cluster."""
    stop = threading.Event()
    if not _EMBEDDED:
        return stop.set

    def loop() -> None:
        while not stop.wait(every_s):
            if (why := embedded_ray_gone()) is not None:
                on_gone(why)
                return

    threading.Thread(target=loop, name="raylane-ray-watchdog", daemon=True).start()
    return stop.set


# --- the reaper: the embedded Ray goes down with its driver, even a SIGKILLed one -------
#
# Ray starts the GCS, raylet, dashboard, monitor and log monitor with a parent-death
# signal, so they die with the driver; but the raylet's children (dashboard agent,
# runtime-env agent, workers) only notice their raylet is gone after 60-130 s. The
# reaper is a small process in its own session (a signal to the driver's process group
# does not reach it) that keeps a list of the embedded Ray's processes and their
# descendants, refreshed every second, and ends them all once the driver is gone.
# ``_stop_reaper`` (a clean ``ray.shutdown``) tells it to leave without doing anything.

_REAPER: list[subprocess.Popen] = []
_REAPER_CODE = "import sys; from raylane.session import _reap; _reap(sys.argv[1:])"


def _start_reaper(roots: list[int]) -> None:
    _stop_reaper()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _REAPER_CODE, str(os.getpid()), *map(str, roots)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as exc:  # without it, a SIGKILLed driver leaves Ray's agents for a minute or two: said, not fatal
        log.warning("no reaper for the embedded Ray (%s): if this process is killed, Ray's agents may outlive it for ~2 minutes", exc)
        return
    _REAPER.append(proc)


def _stop_reaper() -> None:
    while _REAPER:
        proc = _REAPER.pop()
        try:
            proc.stdin.write(b"stop\n")
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


def _reap(argv: list[str]) -> None:
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
