"""Jobs on a real Ray cluster through the Jobs API, as a user drives them: `raylane dev-cluster up`
(a head and two labelled worker nodes started with `ray start`, token authentication on,
the dashboard on 127.0.0.1, its connection written to connection.env), `raylane submit
--follow` to SUCCEEDED ending with its run summary, a RAY_ADDRESS left in the shell neither
rerouting the submission nor the job, the `ray job submit` command `up` prints run as printed,
`ray job submit` of a long raylane job stopped with `raylane stop`, a missing and a wrong
token refused with the way to supply it, and `raylane dev-cluster down` stopping exactly
its own processes.

One cluster for the module, driven through the CLI in subprocesses with their own
environment: a token file of the module's own (never ~/.ray/auth_token), a dev-cluster
record in a temp dir, and free ports, so it neither joins nor disturbs any other Ray on
the machine. The tests run in file order; the last one takes the cluster down.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylane import devcluster, security

pytestmark = [pytest.mark.cluster]

RAY = str(Path(sys.executable).with_name("ray"))


class Dev:
    def __init__(self, root: Path):
        self.root = root
        self.cwd = root / "work"  # where `up` runs, so where job drivers start and write runs/
        self.cwd.mkdir()
        self.state_dir = root / "dev"
        self.token = security.create_token_file(root / "token")
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("RAY_AUTH") and k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        self.env.update(RAY_AUTH_TOKEN_PATH=str(self.token.path), RAYLANE_DEV_CLUSTER_DIR=str(self.state_dir),
                        RAY_USAGE_STATS_ENABLED="0")
        self.state: devcluster.DevClusterState | None = None

    def run(self, *args: str, timeout: float = 90, env: dict | None = None, tool: list[str] | None = None) -> subprocess.CompletedProcess:
        cmd = (tool or [sys.executable, "-m", "raylane"]) + list(args)
        return subprocess.run(cmd, cwd=self.cwd, env=env or self.env, capture_output=True, text=True, timeout=timeout)

    def status(self, submission_id: str) -> dict:
        out = self.run("status", submission_id, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    d = Dev(tmp_path_factory.mktemp("submit"))
    try:
        out = d.run("dev-cluster", "up", "--spot", "1", "--ondemand", "1", "--cpus", "2", "--spot-speed", "2", timeout=150)
        assert out.returncode == 0, out.stdout + out.stderr
        d.state = devcluster.DevClusterState.load(d.state_dir)
        d.up_output = out.stdout
        yield d
    finally:
        if devcluster.DevClusterState.load(d.state_dir) is not None:  # a test failed before `down` ran
            devcluster.down(d.state_dir, log=lambda _m: None)


@pytest.mark.timeout(120)
def test_up_starts_labelled_nodes_that_raylane_reads(dev):
    assert [l.split()[:2] for l in dev.up_output.splitlines() if l.split()[:1] in (["head"], ["on-demand-1"], ["spot-1"])] == [
        ["head", "on-demand"], ["on-demand-1", "on-demand"], ["spot-1", "spot"]]
    # The cluster view raylane's placement uses, built from Ray's node table.
    env = dict(dev.env, RAY_AUTH_MODE="token")
    out = dev.run("cluster", "--address", dev.state.gcs_address, "--json", "--no-calibrate", env=env)
    assert out.returncode == 0, out.stderr
    nodes = [n for n in json.loads(out.stdout)["nodes"] if n["alive"]]
    seen = sorted((n["market"], n["speed"], n["speed_source"], n["cpus"], n["is_head"]) for n in nodes)
    assert seen == [("on-demand", 1.0, "label", 0.0, True), ("on-demand", 1.0, "label", 2.0, False), ("spot", 2.0, "label", 2.0, False)]


@pytest.mark.timeout(120)
def test_joining_by_address_sends_the_token_at_hand_without_ray_auth_mode(dev):
    # Ray sends its token to an explicit address only under RAY_AUTH_MODE=token (it turns that on by
    # itself for "auto" alone); without it this join used to wait out the deadline, refused.
    assert "RAY_AUTH_MODE" not in dev.env and "RAY_AUTH_TOKEN_PATH" in dev.env
    out = dev.run("cluster", "--address", dev.state.gcs_address, "--json", "--no-calibrate", env=dict(dev.env, RAYLANE_CONNECT_TIMEOUT="30"))
    assert out.returncode == 0, out.stderr
    assert len([n for n in json.loads(out.stdout)["nodes"] if n["alive"]]) == 3


@pytest.mark.timeout(60)
def test_the_dashboard_and_jobs_api_listen_on_loopback_only(dev):
    import psutil

    port = int(dev.state.dashboard_url.rsplit(":", 1)[1])
    listening = [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(security.is_loopback(c.laddr.ip) for c in listening), listening
    # What `dev-cluster up --help` says of the rest: the GCS listens on every interface (and asks for the token).
    gcs_port = int(dev.state.gcs_address.rsplit(":", 1)[1])
    gcs = [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == gcs_port]
    assert gcs and not any(security.is_loopback(c.laddr.ip) for c in gcs), gcs


@pytest.mark.timeout(60)
def test_up_writes_the_connection_file_and_prints_the_ray_job_submit_command(dev):
    path = dev.state_dir / devcluster.CONNECTION_FILE
    assert f"connection:     {path}" in dev.up_output
    loaded = subprocess.run(["bash", "-c", f"set -a; . {shlex.quote(str(path))}; set +a; env"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"}, timeout=30).stdout
    env = dict(line.split("=", 1) for line in loaded.splitlines() if line.startswith("RAY_"))
    dash_port = dev.state.dashboard_url.rsplit(":", 1)[1]
    assert env == {"RAY_ADDRESS": dev.state.gcs_address, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dash_port}",
                   "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(dev.token.path)}
    assert (f"from Ray's CLI: RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS=http://127.0.0.1:{dash_port} "
            f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(dev.token.path))} ray job submit -- python -m raylane.jobs.linreg") in dev.up_output


@pytest.mark.timeout(150)
def test_submit_follow_runs_a_job_to_succeeded_with_its_run_summary(dev):
    # No --address: `submit` finds the dev cluster through RAYLANE_DEV_CLUSTER_DIR.
    out = dev.run("submit", "linreg", "--follow", "--set", "driver.max_steps=5", "--set", "workers=2", "--run-name", "follow-1", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    submission_id = flat(out.stdout).split(" as ", 1)[1].split()[0]
    assert "run folder: runs/follow-1" in out.stdout, "the driver's own output is streamed"
    summary = json.loads((dev.cwd / "runs" / "follow-1" / "summary.json").read_text())
    assert (summary["job"], summary["state"], summary["steps"], summary["error"]) == ("linreg", "finished", 5, None)
    assert summary["final_metrics"]["workers"] == 2 and summary["final_metrics"]["loss"] < 1.0
    # It ends as a local run does: final state, steps and metrics, from the job's own last line.
    loss = f"loss={summary['final_metrics']['loss']:.4g}"
    assert f"linreg: finished after 5 steps in {summary['wall_time_s']:.1f} s; {loss}" in out.stdout
    ended = out.stderr.strip().splitlines()[-1]
    assert ended.startswith(f"{submission_id}: SUCCEEDED (linreg finished after 5 steps in ") and loss in ended, out.stderr

    info = dev.status(submission_id)
    assert info["status"] == "SUCCEEDED" and info["metadata"] == {"raylane.job": "linreg", "raylane.run_name": "follow-1"}
    assert "--run-name follow-1" in info["entrypoint"] and "--no-progress" in info["entrypoint"]
    listed = dev.run("list")
    assert listed.returncode == 0 and submission_id in listed.stdout
    logs = dev.run("logs", submission_id)
    assert logs.returncode == 0 and "run folder: runs/follow-1" in logs.stdout
    followed = dev.run("logs", submission_id, "--follow", "--timeout", "60")  # an ended job: the whole log, then its status
    assert followed.returncode == 0 and "run folder: runs/follow-1" in followed.stdout and "SUCCEEDED" in followed.stderr


def test_a_job_of_the_users_own_file_is_shipped_and_followed_to_its_summary(dev):
    example = Path(__file__).resolve().parents[2] / "examples" / "dp_classifier.py"
    out = dev.run("submit", f"{example}:JOB", "--follow", "--set", "driver.max_steps=3", "--run-name", "mine-1", timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    submission_id = flat(out.stdout).split(" as ", 1)[1].split()[0]
    assert "dp_classifier: finished after 3 steps" in out.stdout, out.stdout[-2000:]
    summary = json.loads((dev.cwd / "runs" / "mine-1" / "summary.json").read_text())  # in the cluster's working folder
    assert (summary["job"], summary["state"], summary["steps"]) == ("dp_classifier", "finished", 3)
    info = dev.status(submission_id)
    assert info["metadata"] == {"raylane.job": "dp_classifier", "raylane.run_name": "mine-1"}
    assert "raylane run examples.dp_classifier:JOB --address auto" in info["entrypoint"]


def _cluster_node_ids(dev) -> set[str]:
    out = dev.run("cluster", "--address", dev.state.gcs_address, "--json", "--no-calibrate", env=dict(dev.env, RAY_AUTH_MODE="token"))
    assert out.returncode == 0, out.stderr
    return {n["node_id"] for n in json.loads(out.stdout)["nodes"] if n["alive"]}


def _planned_nodes(run_dir: Path) -> set[str]:
    plans = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if '"plan"' in l]
    return {a["node_id"] for p in plans if p.get("event") == "plan" for a in p["assignments"]}


@pytest.mark.timeout(150)
def test_a_ray_address_in_the_shell_neither_reroutes_the_submission_nor_the_job(dev):
    # A user's shell with RAY_ADDRESS=local: Ray's client used it instead of the dev cluster's Jobs API.
    out = dev.run("submit", "linreg", "--follow", "--set", "driver.max_steps=3", "--run-name", "shell-local", timeout=120,
                  env=dict(dev.env, RAY_ADDRESS="local"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RAY_ADDRESS='local' is not used here" in flat(out.stderr) and dev.state.dashboard_url in flat(out.stderr)
    assert "SUCCEEDED (linreg finished after 3 steps" in out.stderr
    # The job's driver joined the cluster it was submitted to, not a private Ray of its own.
    planned = _planned_nodes(dev.cwd / "runs" / "shell-local")
    assert planned and planned <= _cluster_node_ids(dev), planned
    # The cluster's own GCS address in RAY_ADDRESS is the same cluster: nothing to warn about.
    quiet = dev.run("list", env=dict(dev.env, RAY_ADDRESS=dev.state.gcs_address))
    assert quiet.returncode == 0 and "is not used here" not in quiet.stderr, quiet.stderr


@pytest.mark.timeout(150)
def test_the_ray_job_submit_command_up_prints_runs_as_printed(dev):
    line = next(l for l in dev.up_output.splitlines() if l.startswith("from Ray's CLI: "))
    command = line.split(": ", 1)[1] + " --set driver.max_steps=3 --run-name ray-cli-1"
    # Run by a shell that has RAY_ADDRESS=local and no token settings: the command carries what it needs.
    env = {k: v for k, v in dev.env.items() if k != "RAY_AUTH_TOKEN_PATH"}
    env.update(RAY_ADDRESS="local", PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    out = subprocess.run(["bash", "-c", command], cwd=dev.cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "linreg: finished after 3 steps" in out.stdout and "succeeded" in out.stdout.lower()
    assert _planned_nodes(dev.cwd / "runs" / "ray-cli-1") <= _cluster_node_ids(dev)


@pytest.mark.timeout(90)
def test_following_a_running_job_prints_its_log_once_and_in_order(dev):
    submission_id = "raylane-printer-1"
    script = "import time\nfor i in range(40):\n    print('line', i, flush=True)\n    time.sleep(0.1)"
    out = dev.run("job", "submit", "--address", dev.state.dashboard_url, "--submission-id", submission_id, "--no-wait", "--",
                  "python", "-c", script, tool=[RAY], env=dict(dev.env, RAY_AUTH_MODE="token"))
    assert out.returncode == 0, out.stdout + out.stderr
    followed = dev.run("logs", submission_id, "--follow", "--timeout", "60")
    assert followed.returncode == 0 and f"{submission_id}: SUCCEEDED" in followed.stderr, followed.stderr
    lines = [l for l in followed.stdout.splitlines() if l.startswith("line ")]
    assert lines == [f"line {i}" for i in range(40)]
    assert followed.stdout == dev.run("logs", submission_id).stdout, "the tail and the full log must join without a gap or a repeat"


@pytest.mark.timeout(150)
def test_a_long_job_submitted_with_ray_job_submit_is_stopped(dev):
    submission_id = "raylane-long-1"
    env = dict(dev.env, RAY_AUTH_MODE="token")
    out = dev.run("job", "submit", "--address", dev.state.dashboard_url, "--submission-id", submission_id, "--no-wait", "--",
                  "python", "-m", "raylane.jobs.linreg", "--set", "driver.max_steps=1000000", "--run-name", "long-1",
                  tool=[RAY], env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 90  # a loaded 2-core machine starts a driver slowly
    while (status := dev.status(submission_id)["status"]) != "RUNNING":
        assert status == "PENDING" and time.monotonic() < deadline, status
        time.sleep(0.5)
    # Let the driver get into its steps, so the stop interrupts real work.
    while not (dev.cwd / "runs" / "long-1" / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, dev.run("logs", submission_id).stdout
        time.sleep(0.5)
    stopped = dev.run("stop", submission_id, "--wait", "60")
    assert stopped.returncode == 0 and f"{submission_id}: STOPPED" in stopped.stdout, stopped.stdout + stopped.stderr
    assert dev.status(submission_id)["status"] == "STOPPED"


@pytest.mark.timeout(120)
def test_a_missing_or_wrong_token_is_refused_with_how_to_supply_it(dev):
    before = dev.run("list", "--json")
    assert before.returncode == 0

    home = dev.root / "empty-home"  # no ~/.ray/auth_token to fall back on
    home.mkdir(exist_ok=True)
    no_token = {k: v for k, v in dev.env.items() if k != "RAY_AUTH_TOKEN_PATH"} | {"HOME": str(home)}
    out = dev.run("submit", "linreg", "--set", "driver.max_steps=2", env=no_token)
    text = flat(out.stderr)
    assert out.returncode == 2 and "requires an authentication token and none was found" in text, out.stderr
    assert "RAY_AUTH_TOKEN_PATH" in text and "~/.ray/auth_token" in text and "Traceback" not in out.stderr

    wrong = dict(dev.env, RAY_AUTH_TOKEN="not-the-token")
    out = dev.run("submit", "linreg", "--set", "driver.max_steps=2", env=wrong)
    text = flat(out.stderr)
    assert out.returncode == 2 and "refused the token from RAY_AUTH_TOKEN" in text and "Traceback" not in out.stderr, out.stderr

    after = dev.run("list", "--json")
    assert json.loads(after.stdout) == json.loads(before.stdout), "a refused submission must not create a job"


@pytest.mark.timeout(60)
def test_a_token_file_others_can_read_is_used_with_a_warning_and_the_fix(dev):
    loose = dev.root / "loose-token"
    loose.write_text(dev.token.value)
    loose.chmod(0o644)
    out = dev.run("list", env=dict(dev.env, RAY_AUTH_TOKEN_PATH=str(loose)))
    assert out.returncode == 0, out.stderr
    assert f"chmod 600 {loose}" in flat(out.stderr)


@pytest.mark.timeout(120)
def test_down_stops_exactly_the_dev_clusters_processes(dev):
    ours = {p.pid for p in devcluster.processes(dev.state.cluster_id)}
    assert len(ours) >= 6, "a head and two nodes: GCS, dashboard, raylets, agents"
    # Bystanders: an unrelated process, and one carrying another dev cluster's marker.
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             env=dict(os.environ, **{devcluster.MARKER_ENV: "someone-else"}))
    try:
        out = dev.run("dev-cluster", "down")
        assert out.returncode == 0 and f"stopped the dev cluster {dev.state.cluster_id}" in out.stdout, out.stdout + out.stderr
        assert devcluster.processes(dev.state.cluster_id) == []
        assert plain.poll() is None and other.poll() is None, "down must stop nothing it did not start"
        assert not (dev.state_dir / "state.json").exists() and not Path(dev.state.temp_dir).exists()
        again = dev.run("dev-cluster", "down")
        assert again.returncode == 0 and "nothing to stop" in again.stdout
    finally:
        for p in (plain, other):
            p.kill()
            p.wait(timeout=30)
