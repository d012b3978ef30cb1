"""The embedded Ray of a `raylane run` is private to the machine and to its driver: every
process of the run listens on loopback only, and none outlives a SIGKILLed driver."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from raylane.runlog import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def _alive(p: psutil.Process) -> bool:
    try:  # a killed process whose parent has not reaped it yet is a zombie: dead for this purpose
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to IPv4 loopback
    return addr.is_loopback


def _listening(tree: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    found = []
    for p in tree:
        try:
            found += [(p.pid, p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # gone meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    """A long `raylane run linreg` on its own embedded Ray, in its own session, a few steps in."""
    tmp = tmp_path_factory.mktemp("loopback")
    home = tmp / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "RAYLANE_HOME": str(tmp / "rl"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    runs = tmp / "runs"
    cmd = [sys.executable, "-m", "raylane", "run", "linreg", "--run-name", "lo", "--no-progress", "--set", f"driver.runs_dir={runs}",
           "--set", "driver.max_steps=1000000", "--set", "driver.tensorboard=false"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        while len(read_jsonl(runs / "lo" / "metrics.jsonl")) < 3:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        yield proc, tree
    finally:
        for p in tree:  # whatever the reaper missed, so no test leaves processes behind
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def test_every_process_of_an_embedded_run_listens_on_loopback_only(embedded_run):
    proc, _ = embedded_run
    driver = psutil.Process(proc.pid)
    listening = _listening([driver, *driver.children(recursive=True)])
    assert any(name == "gcs_server" for _, name, _, _ in listening), listening  # the check sees Ray's sockets at all
    exposed = [s for s in listening if not _is_loopback(s[2])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_a_sigkilled_driver_takes_its_embedded_ray_down(embedded_run):
    proc, tree = embedded_run
    driver = psutil.Process(proc.pid)
    tree += [driver, *driver.children(recursive=True)]
    assert {"gcs_server", "raylet"} <= {p.name() for p in tree}, [p.name() for p in tree]
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: not its process group
    proc.wait(30)
    deadline = time.monotonic() + 30
    while (alive := [(p.pid, p.name()) for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"still running 30 s after the driver was SIGKILLed: {alive}"
