"""Secure defaults, as pure checks: where the token comes from, who may read it, and which
dashboard bindings are refused (no Ray is started here)."""

from __future__ import annotations

import stat

import pytest
from typer.testing import CliRunner

from raylane import security
from raylane.cli import app
from raylane.security import SecurityError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def write(path, text, mode=0o600):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_token_lookup_follows_rays_order(tmp_path):
    home = tmp_path / "home"
    write(home / ".ray" / "auth_token", "from-default\n")
    named = write(tmp_path / "named", "from-path\n")
    assert security.find_token({"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_TOKEN_PATH": str(named)}, home).value == "from-env"
    token = security.find_token({"RAY_AUTH_TOKEN_PATH": str(named)}, home)
    assert (token.value, token.path) == ("from-path", named) and "RAY_AUTH_TOKEN_PATH" in token.source
    assert security.find_token({}, home).value == "from-default"
    assert security.find_token({}, tmp_path / "nobody") is None


@pytest.mark.parametrize("content", [None, "  \n"])
def test_a_token_path_that_cannot_be_used_is_an_error_not_a_fallback(tmp_path, content):
    home = tmp_path / "home"
    write(home / ".ray" / "auth_token", "would-be-wrong")
    named = tmp_path / "token"
    if content is not None:
        write(named, content)
    with pytest.raises(SecurityError, match="RAY_AUTH_TOKEN_PATH=.*token"):
        security.find_token({"RAY_AUTH_TOKEN_PATH": str(named)}, home)


def test_a_token_file_others_can_read_is_reported_with_the_fix(tmp_path):
    loose = write(tmp_path / "loose", "t", 0o644)
    message = security.token_file_warning(loose)
    assert message is not None and "mode 644" in message and f"chmod 600 {loose}" in message
    assert security.token_file_warning(write(tmp_path / "group", "t", 0o640)) is not None
    assert security.token_file_warning(write(tmp_path / "tight", "t", 0o600)) is None


def test_a_created_token_is_private_and_never_overwrites(tmp_path):
    path = tmp_path / "sub" / "auth_token"
    token = security.create_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token.value) == 64
    with pytest.raises(FileExistsError):
        security.create_token_file(path)
    assert path.read_text() == token.value


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("10.0.0.5", False), ("head.example", False)])
def test_loopback(host, loopback):
    assert security.is_loopback(host) is loopback


def test_binding_the_dashboard_elsewhere_without_a_token_is_refused_with_the_reason():
    with pytest.raises(SecurityError) as info:
        security.check_dashboard_host("0.0.0.0", "disabled")
    text = str(info.value)
    assert "0.0.0.0" in text and "runs any command" in text and "127.0.0.1" in text and "RAY_AUTH_MODE" in text


def test_allowed_bindings_and_their_warnings():
    assert security.check_dashboard_host("127.0.0.1", "token") is None
    assert "unencrypted" in security.check_dashboard_host("0.0.0.0", "token")
    assert "RAY_AUTH_MODE=disabled" in security.check_dashboard_host("127.0.0.1", "disabled")
    with pytest.raises(SecurityError, match="empty"):
        security.check_dashboard_host(" ", "token")


def test_auth_mode_defaults_to_token_and_refuses_unknown_values():
    assert security.auth_mode({}) == "token"
    assert security.auth_mode({"RAY_AUTH_MODE": "DISABLED"}) == "disabled"
    with pytest.raises(SecurityError, match="'tokn'.*'token'"):
        security.auth_mode({"RAY_AUTH_MODE": "tokn"})


def test_a_token_sent_in_clear_to_another_machine_is_warned_about():
    assert security.plain_http_warning("http://10.0.0.5:8265", "10.0.0.5") is not None
    assert security.plain_http_warning("http://127.0.0.1:8265", "127.0.0.1") is None
    assert security.plain_http_warning("https://ray.example:443", "ray.example") is None


def test_dev_cluster_refuses_a_reachable_dashboard_without_token_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    result = CliRunner().invoke(app, ["dev-cluster", "up", "--dashboard-host", "0.0.0.0", "--dir", str(tmp_path / "dev")])
    assert result.exit_code == 2, result.output
    assert "refusing to bind the dashboard to 0.0.0.0" in " ".join(result.output.split())
    assert not (tmp_path / "dev" / "state.json").exists()



def test_the_token_in_use_is_checked_only_when_token_auth_is_on(tmp_path):
    loose = write(tmp_path / "loose", "t", 0o644)
    env = {"RAY_AUTH_TOKEN_PATH": str(loose)}
    assert "chmod 600" in security.loose_token_warning({**env, "RAY_AUTH_MODE": "token"})
    assert security.loose_token_warning({**env, "RAY_AUTH_MODE": "disabled"}) is None
    assert security.loose_token_warning({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "in-env", **env}) is None
