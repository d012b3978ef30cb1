"""Joining an existing Ray cluster with a deadline, and a local start bound to loopback.

``ray.init(address=...)`` retries an unreachable GCS for minutes and ignores signals
meanwhile; here the GCS port is probed first, ``ray.init`` itself is bounded, and every
failure is a :class:`ConnectError` naming the address and what to check.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

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


class loopback_node:
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
    if not 1 <= int(port) <= 65535:
        raise ConnectError(f"Ray address {address!r}: port {int(port)} is outside 1..65535; pass the head's GCS port (6379 unless `ray start --port` said otherwise)")
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


def join(address: str, kwargs: dict, timeout_s: float) -> None:
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
    from raylane import raystate

    raystate.prefer_token_auth()
    target = f"{answered[0]}:{answered[1]}" if loopback_only else address
    outcome: dict = {}

    def init() -> None:
        try:
            with loopback_node() if loopback_only else contextlib.nullcontext():
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
    try:
        while worker.is_alive() and time.monotonic() < deadline:  # short joins: signals (Ctrl-C, SIGTERM) still get through
            worker.join(min(0.2, max(0.0, deadline - time.monotonic())))
    finally:
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


