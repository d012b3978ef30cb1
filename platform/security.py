"""Secure defaults for every Ray that raylane starts or talks to: pure checks, no Ray.

Ray's token authentication (``RAY_AUTH_MODE=token``) guards the GCS, the node
managers and the dashboard, whose Jobs API runs arbitrary commands. raylane keeps it
on, binds the dashboard to loopback unless told otherwise, refuses a reachable
dashboard without a token, and says so when the token file can be read by others.

The token is looked up the way Ray looks it up, so raylane and ``ray job submit``
always agree on which one is used:

1. ``RAY_AUTH_TOKEN``: the token itself;
2. ``RAY_AUTH_TOKEN_PATH``: a file holding it (set but unreadable or empty is an
   error, as in Ray: silently falling back to another token would hide the mistake);
3. ``~/.ray/auth_token``.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
AUTH_MODE_ENV = "RAY_AUTH_MODE"

HOW_TO_SUPPLY = (
    f"raylane (like Ray) reads the token from {TOKEN_ENV} (the token itself), else from the file named by "
    f"{TOKEN_PATH_ENV}, else from ~/.ray/auth_token. On the head node `ray get-auth-token` prints it; "
    "on KubeRay it is in the cluster's Secret (see deploy/README.md). "
    f"For example: export {TOKEN_PATH_ENV}=/path/to/token (a file only you can read: chmod 600)."
)


class SecurityError(ValueError):
    """A setting that would expose a cluster was refused; the message says what to change."""


@dataclass(frozen=True)
class Token:
    """A Ray auth token and where it came from (never printed: only ``source`` is)."""

    value: str
    source: str
    path: Path | None = None


def default_token_path(home: Path | None = None) -> Path:
    return (home or Path.home()) / ".ray" / "auth_token"


def find_token(env: Mapping[str, str] | None = None, home: Path | None = None) -> Token | None:
    """The token Ray would use, with its source; ``None`` when there is none.

    >>> find_token({"RAY_AUTH_TOKEN": "abc"}).source
    'RAY_AUTH_TOKEN'
    """
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV, "").strip():
        return Token(env[TOKEN_ENV].strip(), TOKEN_ENV)
    named = env.get(TOKEN_PATH_ENV, "")
    if named:
        path = Path(named).expanduser()
        try:
            value = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SecurityError(f"{TOKEN_PATH_ENV}={named!r} names a file that cannot be read ({exc.strerror}); "
                                f"point it at the cluster's token file, or unset it to use ~/.ray/auth_token") from None
        if not value:
            raise SecurityError(f"{TOKEN_PATH_ENV}={named!r} names an empty file; put the cluster's token in it")
        return Token(value, f"{path} ({TOKEN_PATH_ENV})", path)
    path = default_token_path(home)
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError:  # no default file: no token, which is not an error by itself
        return None
    return Token(value, str(path), path) if value else None


def token_file_warning(path: Path) -> str | None:
    """A warning (with the fix) when users other than the owner may read the token file."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (f"the token file {path} can be read by other users (mode {mode:03o}); anyone who reads it can run "
            f"code on the cluster. Fix: chmod 600 {path}")


def loose_token_warning(env: Mapping[str, str] | None = None) -> str | None:
    """The :func:`token_file_warning` for the token Ray uses in this process, if token auth is on."""
    env = os.environ if env is None else env
    if env.get(AUTH_MODE_ENV, "").strip().lower() != "token":
        return None
    try:
        token = find_token(env)
    except SecurityError:  # Ray itself refuses that setting, with its own message
        return None
    return token_file_warning(token.path) if token is not None and token.path is not None else None


def create_token_file(path: Path) -> Token:
    """Write a fresh random token to ``path``, readable by its owner only.

    The file is created with mode 600 in one step (no window where it is readable)
    and never overwritten: an existing token may be what a running cluster uses.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    value = secrets.token_hex(32)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(value)
    return Token(value, str(path), path)


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost`` are loopback; ``0.0.0.0`` (every interface) is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything, so treat it as reachable


def auth_mode(env: Mapping[str, str] | None = None) -> str:
    """What raylane starts Ray with: ``token`` unless the user opted out with ``RAY_AUTH_MODE=disabled``."""
    env = os.environ if env is None else env
    mode = env.get(AUTH_MODE_ENV, "token").strip().lower() or "token"
    if mode not in ("token", "disabled"):
        raise SecurityError(f"{AUTH_MODE_ENV}={env.get(AUTH_MODE_ENV)!r}: expected 'token' (raylane's default) or 'disabled'")
    return mode


def check_dashboard_host(host: str, mode: str) -> str | None:
    """Refuse a dashboard (and with it the Jobs API) reachable from other machines without
    token authentication; returns a warning for the allowed but notable cases."""
    if not host.strip():
        raise SecurityError("--dashboard-host is empty; give 127.0.0.1 (the default) or the address to bind")
    if is_loopback(host):
        if mode != "token":
            return (f"token authentication is off ({AUTH_MODE_ENV}=disabled): every local user can submit jobs, and Ray's "
                    "GCS and node ports listen on all interfaces without a token. Unset it to keep the token on.")
        return None
    if mode != "token":
        raise SecurityError(
            f"refusing to bind the dashboard to {host} with token authentication off ({AUTH_MODE_ENV}=disabled): the "
            "Jobs API on it runs any command it is sent, so anyone who can reach that address could run code on "
            f"this machine. Keep --dashboard-host 127.0.0.1 (reach it through an SSH tunnel or kubectl port-forward), "
            f"or unset {AUTH_MODE_ENV} so raylane keeps token authentication on.")
    return (f"the dashboard and Jobs API will listen on {host}, reachable from the network; the token protects them but "
            "travels unencrypted over HTTP. Prefer 127.0.0.1 with an SSH tunnel, or TLS in front of it.")


def plain_http_warning(url: str, host: str) -> str | None:
    """Sending the token over plain HTTP to another machine exposes it on the way."""
    if url.startswith("http://") and not is_loopback(host):
        return (f"sending the cluster token over plain HTTP to {host}; anyone on the path can read it. Use an SSH tunnel "
                "or `kubectl port-forward` and --address http://127.0.0.1:PORT, or an https:// address.")
    return None
