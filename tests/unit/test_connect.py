"""Joining a cluster that is not there, or not answering, ends within the connect deadline
with one clear line; no Ray is started (the probe fails first, or ray.init is bounded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from raylane import join, session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raylane(args: list[str], tmp_path, deadline_s: float = 3, **extra: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(tmp_path), RAYLANE_HOME=str(tmp_path / "rl"), RAYLANE_CONNECT_TIMEOUT=str(deadline_s), RAY_USAGE_STATS_ENABLED="0",
               COLUMNS="400", **extra)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "raylane", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.mark.parametrize("command", [
    ["run", "linreg", "--set", "driver.tensorboard=false"],
    ["pools", "somerun"],
    ["scale", "somerun", "grad_worker", "2", "--timeout", "20"],
    ["cluster"],
])
def test_nothing_listening_fails_within_the_deadline_naming_the_address(command, tmp_path):
    port = _closed_port()
    done, took = _raylane([*command, "--address", f"127.0.0.1:{port}"], tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"127.0.0.1:{port}" in done.stderr and "nothing answered within 3 s" in done.stderr, done.stderr
    assert "RAYLANE_CONNECT_TIMEOUT" in done.stderr
    assert took < 60, took  # hang detection only: the connect itself gives up after 3 s (imports come on top)


@pytest.fixture()
def silent_port():
    """A loopback port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_port_that_answers_but_is_not_ray_fails_within_the_deadline_with_the_token_hint(silent_port, tmp_path):
    port = silent_port
    done, took = _raylane(["pools", "somerun", "--address", f"127.0.0.1:{port}"], tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"127.0.0.1:{port}" in done.stderr and "handshake did not finish within 3 s" in done.stderr, done.stderr
    assert "RAY_AUTH_TOKEN" in done.stderr and "auth_token" in done.stderr
    assert took < 60, took


def test_token_authentication_without_a_token_says_how_to_pass_one(silent_port, tmp_path):
    done, took = _raylane(["pools", "somerun", "--address", f"127.0.0.1:{silent_port}"], tmp_path, RAY_AUTH_MODE="token")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"cannot authenticate to the Ray cluster at 127.0.0.1:{silent_port}" in done.stderr, done.stderr
    assert "RAY_AUTH_TOKEN=<token>" in done.stderr and "RAY_AUTH_TOKEN_PATH" in done.stderr and "~/.ray/auth_token" in done.stderr
    assert took < 60, took


def test_the_deadline_comes_from_the_environment_and_bad_values_say_what_to_set(monkeypatch):
    monkeypatch.delenv(session.CONNECT_TIMEOUT_ENV, raising=False)
    assert session.connect_timeout_s() == session.DEFAULT_CONNECT_TIMEOUT_S == 30
    monkeypatch.setenv(session.CONNECT_TIMEOUT_ENV, "4.5")
    assert session.connect_timeout_s() == 4.5 and session.connect_timeout_s(2) == 2
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(session.CONNECT_TIMEOUT_ENV, bad)
        with pytest.raises(session.ConnectError, match="RAYLANE_CONNECT_TIMEOUT.*set it to e.g. 30"):
            session.connect_timeout_s()


def test_a_loopback_address_is_also_tried_as_given(monkeypatch):
    # Ray turns 127.0.0.1 into this machine's IP; an embedded raylane Ray answers on loopback only.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shown, pairs = join._target("127.0.0.1:6379")
    assert pairs[-1] == ("127.0.0.1", 6379) and "127.0.0.1:6379" in shown
    with pytest.raises(session.ConnectError, match="not host:port|cannot use Ray address"):
        join._target("nonsense")


def test_the_probe_gives_up_at_its_deadline_and_finds_a_listener():
    port = _closed_port()
    started = time.monotonic()
    answered, attempts, last = join._probe([("127.0.0.1", port)], time.monotonic() + 1.5)
    assert answered is None and attempts >= 2 and f"127.0.0.1:{port}" in last
    assert time.monotonic() - started < 10
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        pair = ("127.0.0.1", server.getsockname()[1])
        assert join._probe([("127.0.0.1", port), pair], time.monotonic() + 5)[0] == pair


def test_a_job_module_entrypoint_fails_the_same_way_without_a_traceback(tmp_path):
    port = _closed_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(tmp_path), RAYLANE_CONNECT_TIMEOUT="3", RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-m", "raylane.jobs.linreg", "--address", f"127.0.0.1:{port}", "--set", "driver.tensorboard=false"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"127.0.0.1:{port}" in done.stderr and "nothing answered within 3 s" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["pools", "norecord"], ["scale", "norecord", "grad_worker", "2"]])
def test_a_run_without_a_record_here_is_not_looked_for_in_whatever_ray_runs_on_the_host(command, tmp_path):
    done, took = _raylane(command, tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "run 'norecord' is not running on this machine" in done.stderr and "--address" in done.stderr, done.stderr


def test_a_port_out_of_range_is_refused_at_once(tmp_path):
    done, took = _raylane(["pools", "somerun", "--address", "127.0.0.1:99999"], tmp_path, deadline_s=30)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "port 99999 is outside 1..65535" in done.stderr, done.stderr
    assert took < 25, took  # refused before the 30 s connect deadline, not after it
