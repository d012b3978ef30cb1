"""`raylane submit` and friends refuse bad input before anything is sent, build the command a
cluster runs, and find the cluster; no Ray is started here."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raylane import registry, submission
from raylane.cli import app
from raylane.prepare import job_config as load_job_config
from raylane.submission import SubmissionError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def recorder():
    """A local HTTP server that answers nothing useful and counts every request it gets."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            self.send_response(500)
            self.end_headers()

        do_POST = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


@pytest.fixture(autouse=True)
def no_ambient_cluster(tmp_path, monkeypatch):
    # Whatever the machine has (a dev cluster record, an address in the environment) must not leak in.
    monkeypatch.setenv("RAYLANE_DEV_CLUSTER_DIR", str(tmp_path / "no-dev-cluster"))
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["linreq"], "unknown job 'linreq'. Did you mean 'linreg'?"),
        (["linreg", "--set", "workrs=2"], "unknown key 'workrs'"),
        (["linreg", "--set", "workers=0"], "workers: must be >= 1, got 0"),
        (["linreg", "--set", "workers=9"], "workers (9) must not exceed max_workers (8)"),
        (["linreg", "--set", "workers"], "key=value"),
        (["linreg", "--config", "no/such/file.yaml"], "no/such/file.yaml"),
        (["linreg", "--run-name", "a/b"], "--run-name 'a/b'"),
        (["examples/dp_classifier.py:JOB", "--set", "wokers=2"], "unknown key 'wokers' for DPConfig"),
    ],
)
def test_a_bad_submission_is_refused_before_anything_is_sent(recorder, args, message):
    url, seen = recorder
    result = CliRunner().invoke(app, ["submit", *args, "--address", url])
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)
    assert seen == [], "nothing may reach the cluster before the config is valid"


@pytest.mark.parametrize(
    "address, message",
    [
        ("auto", "needs the dashboard's URL"),
        ("127.0.0.1:6379", "port 6379 is Ray's GCS"),
        ("ftp://127.0.0.1:8265", "not a Jobs API address"),
        ("http://127.0.0.1:notaport", "not a Jobs API address"),
    ],
)
def test_an_address_that_is_not_a_jobs_api_url_is_refused(address, message):
    result = CliRunner().invoke(app, ["list", "--address", address])
    assert result.exit_code == 2 and message in flat(result.output), result.output


def test_an_unreachable_cluster_is_one_sentence_not_a_stack_trace():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(app, ["status", "raysubmit_x", "--address", f"127.0.0.1:{port}"])
    assert result.exit_code == 2
    assert f"cannot reach the Ray Jobs API at http://127.0.0.1:{port}" in flat(result.output)
    assert "Traceback" not in result.output


def test_addresses_are_found_in_order(tmp_path, monkeypatch):
    from raylane.devcluster import DevClusterState

    assert submission.resolve_address(None) == ("http://127.0.0.1:8265", "the default")
    state_dir = tmp_path / "dev"
    monkeypatch.setenv("RAYLANE_DEV_CLUSTER_DIR", str(state_dir))
    DevClusterState("abc", "127.0.0.1:1", "http://127.0.0.1:4321", "127.0.0.1", str(tmp_path), "token", None).save(state_dir)
    assert submission.resolve_address(None)[0] == "http://127.0.0.1:4321"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "127.0.0.1:5555")
    assert submission.resolve_address(None) == ("http://127.0.0.1:5555", "RAY_API_SERVER_ADDRESS")
    assert submission.resolve_address("https://ray.example/") == ("https://ray.example", "--address")


def test_a_config_file_travels_as_set_values_that_build_the_same_config(tmp_path):
    spec = registry.get("linreg")
    path = tmp_path / "linreg.yaml"
    # A date-like run name and a quoted number stay strings; nested keys become dotted ones.
    path.write_text("workers: 3\nlr: 1.0e-2\ndriver:\n  max_steps: 7\n  run_name: '2024-05-01'\n  runs_dir: '123'\n")
    user = ["lr=0.3"]
    overrides = submission.config_overrides(str(path), user)
    assert overrides[-1] == "lr=0.3", "the user's --set comes last, so it wins over the file"
    via_file = load_job_config(spec, config_file=str(path), overrides=user)
    via_sets = load_job_config(spec, overrides=overrides)
    assert via_sets == via_file and via_sets.driver.run_name == "2024-05-01" and via_sets.driver.runs_dir == "123"


def test_the_entrypoint_is_the_jobs_module_with_every_value_quoted():
    command = submission.entrypoint("linreg", ["driver.run_name=a b", "x=[1, 2]", "y=$(rm -rf ~)"], run_name="r 1")
    assert shlex.split(command) == ["python", "-m", "raylane.jobs.linreg", "--set", "driver.run_name=a b", "--set", "x=[1, 2]",
                                    "--set", "y=$(rm -rf ~)", "--run-name", "r 1", "--no-progress"]
    with pytest.raises(SubmissionError, match="no raylane.jobs entry point"):
        submission.entrypoint("nope", [])


@pytest.mark.parametrize("job", sorted(registry.available()))
def test_every_job_module_runs_as_a_script(job):
    # `ray job submit -- python -m raylane.jobs.JOB` needs the module to call job_main when run as __main__.
    module = submission.job_module(job)
    source = Path(__import__(module, fromlist=["_"]).__file__).read_text()
    mains = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert mains and "job_main(JOB)" in ast.unparse(mains[-1]), f"{module} has no `if __name__ == '__main__': job_main(JOB)`"


def test_a_job_module_takes_the_same_flags_as_raylane_run():
    out = subprocess.run([sys.executable, "-m", "raylane.jobs.linreg", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--config", "--set", "--address", "--run-name", "--no-progress"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, "-m", "raylane.jobs.linreg", "--set", "workers=0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "workers: must be >= 1, got 0" in bad.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--spot", "-1"], "node counts must be >= 0"),
        (["--cpus", "0"], "needs >= 1 CPU"),
        (["--spot-speed", "0"], "--spot-speed 0.0: must be a finite number > 0"),
        (["--spot", "40"], "at most 16 on one machine"),
    ],
)
def test_dev_cluster_refuses_bad_sizes_before_starting_anything(tmp_path, args, message):
    result = CliRunner().invoke(app, ["dev-cluster", "up", *args, "--dir", str(tmp_path / "dev")])
    assert result.exit_code == 2 and message in flat(result.output), result.output
    assert not (tmp_path / "dev").exists()


def test_dev_cluster_down_without_a_cluster_says_so(tmp_path):
    result = CliRunner().invoke(app, ["dev-cluster", "down", "--dir", str(tmp_path / "dev")])
    assert result.exit_code == 0 and "nothing to stop" in result.output


@pytest.mark.parametrize("variable, value", [("RAY_ADDRESS", "local"), ("RAY_ADDRESS", "auto"), ("RAY_API_SERVER_ADDRESS", "127.0.0.1:1")])
def test_an_address_in_the_shell_does_not_reroute_the_jobs_client(recorder, monkeypatch, variable, value):
    # Ray's client lets $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, override the address it is given: with
    # RAY_ADDRESS=local it went looking for a GCS on this machine instead of asking the Jobs API at --address.
    url, seen = recorder
    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(app, ["list", "--address", url])
    assert "/api/version" in seen, f"the Jobs API at --address was never asked: {result.output}"
    # no 401 blamed on the token: the recorder's port may itself hold the digits 401, so match a status, not a substring
    assert result.exit_code == 2 and url in flat(result.output) and not re.search(r"(?<![\d:])401(?!\d)", result.output)
    import os

    assert os.environ[variable] == value, "the shell's variable is put back"
    if variable == "RAY_ADDRESS":
        assert f"RAY_ADDRESS={value!r} is not used here: raylane sends jobs to the Jobs API at {url}" in flat(result.output)


def test_ray_address_is_only_warned_about_when_it_names_another_cluster():
    url = "http://127.0.0.1:8265"
    assert submission.ambient_address_note(url, {}) is None
    assert submission.ambient_address_note(url, {"RAY_ADDRESS": "http://127.0.0.1:8265/"}) is None
    assert submission.ambient_address_note(url, {"RAY_ADDRESS": "127.0.0.1:6400"}, same_cluster=["127.0.0.1:6400"]) is None
    for other in ("local", "auto", "127.0.0.1:6379", "http://10.0.0.5:8265"):
        note = submission.ambient_address_note(url, {"RAY_ADDRESS": other})
        assert note and repr(other) in note and url in note and "joins the cluster it runs on" in note


def test_the_run_summary_a_job_prints_is_read_back_from_its_log():
    from raylane.launch import summary_line

    summary = {"run": "r", "state": "finished", "steps": 5, "wall_time_s": 1.84, "final_metrics": {"loss": 0.0100929, "workers": 2}}
    log = f"Running entrypoint for job x\nstep noise: finished after 9 steps? no\n{summary_line('linreg', summary)}\nrun folder: runs/r\n"
    assert submission.final_summary(log) == "linreg finished after 5 steps in 1.8 s; loss=0.01009, workers=2"
    stopped = summary_line("linreg", {**summary, "state": "stopped", "stop_reason": "SIGTERM"})
    assert submission.final_summary(stopped + "\n") == "linreg stopped at step 5 (SIGTERM); run again with --run-name r to continue"
    assert submission.final_summary("Traceback (most recent call last):\n  ...\n") is None


def test_dev_cluster_up_help_says_what_listens_where():
    result = CliRunner().invoke(app, ["dev-cluster", "up", "--help"], env={"COLUMNS": "200"})
    text = flat(result.output)
    assert result.exit_code == 0 and "loopback-only" not in text
    assert "--dashboard-host (127.0.0.1 by default)" in text and "GCS, raylets and node agents listen on all interfaces" in text
    assert "connection.env" in text


def test_the_connection_file_and_the_ray_job_submit_command_name_the_cluster(tmp_path):
    from raylane import devcluster

    token = tmp_path / "my token"
    state = devcluster.DevClusterState("abc", "127.0.0.1:6400", "http://127.0.0.1:4321", "127.0.0.1", str(tmp_path), "token",
                                       f"{token} (RAY_AUTH_TOKEN_PATH)", str(token))
    path = devcluster.write_connection_file(state, tmp_path)
    out = subprocess.run(["bash", "-c", f"set -a; . {shlex.quote(str(path))}; set +a; env"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=30)
    loaded = dict(line.split("=", 1) for line in out.stdout.splitlines() if line.startswith("RAY_"))
    assert loaded == {"RAY_ADDRESS": "127.0.0.1:6400", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:4321",
                      "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    assert devcluster.submit_command(state) == (f"RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS=http://127.0.0.1:4321 "
                                                f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(token))} ray job submit -- python -m raylane.jobs.linreg")


def test_a_users_job_travels_as_a_package_and_runs_through_raylane_run(tmp_path, monkeypatch):
    from pathlib import Path

    from raylane.submission import SubmissionError, entrypoint, shipped

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    assert shipped("examples/dp_classifier.py:JOB") == ("examples.dp_classifier:JOB", [str(root / "examples")])
    assert entrypoint("examples.dp_classifier:JOB", ["workers=2"], "r1") == (
        "python -m raylane run examples.dp_classifier:JOB --address auto --set workers=2 --run-name r1 --no-progress")
    (tmp_path / "my-jobs").mkdir()
    (tmp_path / "my-jobs" / "job.py").write_text("")
    with pytest.raises(SubmissionError, match="folder 'my-jobs' travels to the cluster as a Python package"):
        shipped(f"{tmp_path / 'my-jobs' / 'job.py'}:JOB")
    (tmp_path / "single.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SubmissionError, match="'single' is a single-file module; submit it as path/to/single.py:JOB"):
        shipped("single:JOB")
