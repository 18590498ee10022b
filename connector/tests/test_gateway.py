"""`kvtier gateway`: profile files, the active pointer, and the channel test's diagnosis.

The diagnosis is tested against real HTTP servers started here (401, 404, a valid `choices`
body, a slow answer) and a closed port: what is under test is the client's classification of
what it gets back, not vLLM. The channel test against the real vLLM server belongs to the
serving role's end-to-end tests.
"""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtier_tools.gateway.channel import Outcome, check_profile
from kvtier_tools.gateway.cli import main as gateway_main
from kvtier_tools.gateway.profile import (
    GatewayError,
    Profile,
    active_profile_name,
    load_profile,
    profile_from_toml,
    profile_to_toml,
)

KEY = "sk-test-0123456789"
MODEL = "tiny"


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Answers like an OpenAI-compatible server at /v1, with vLLM's error bodies."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        request = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/slow/v1/chat/completions":
            time.sleep(2)
            self._reply(200, {"choices": [{"message": {"content": "late"}}]})
        elif self.path == "/base-model/v1/chat/completions":
            # vLLM's answer for a model whose tokenizer has no chat template.
            message = (
                "As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one."
            )
            self._reply(400, {"error": {"message": message, "code": 400}})
        elif self.path == "/html/v1/chat/completions":
            self._reply(200, "<html>a login page</html>")
        elif self.path != "/v1/chat/completions":
            self._reply(404, {"detail": "Not Found"})
        elif self.headers.get("Authorization") != f"Bearer {KEY}":
            self._reply(401, {"error": "Unauthorized"})
        elif request.get("model") != MODEL:
            message = f"The model `{request.get('model')}` does not exist."
            self._reply(404, {"error": {"message": message, "code": 404}})
        else:
            self._reply(
                200,
                {"model": MODEL, "choices": [{"index": 0, "message": {"content": "p"}}]},
            )

    def _reply(self, code: int, body: object) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Keep pytest output clean."""


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on: bound, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _profile(base_url: str, **overrides: object) -> Profile:
    fields: dict[str, object] = {
        "name": "t",
        "base_url": base_url,
        "api_key": KEY,
        "default_model": MODEL,
        "timeout_secs": 5,
    }
    fields.update(overrides)
    return Profile(**fields)  # type: ignore[arg-type]


def test_valid_server_answers_ok(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1"))
    assert result.outcome is Outcome.OK, result.message
    assert f"'{MODEL}' answered" in result.message


def test_wrong_key_is_401_with_whitespace_hint(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1", api_key="sk-wrong"))
    assert result.outcome is Outcome.AUTH
    assert "HTTP 401" in result.message
    assert "whitespace" in result.message


def test_space_inside_key_is_named_before_sending(server: str) -> None:
    # Headers allow a space, so tools send it and get a bare 401; name the real cause instead.
    result = check_profile(_profile(f"{server}/v1", api_key="sk-test 0123456789"))
    assert result.outcome is Outcome.KEY_WHITESPACE
    assert "whitespace" in result.message


def test_trailing_newline_in_key_is_named_before_sending(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1", api_key=KEY + "\n"))
    assert result.outcome is Outcome.KEY_WHITESPACE
    assert "newline" in result.message


def test_trailing_slash_in_base_url_is_diagnosed(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1/"))
    assert result.outcome is Outcome.BAD_BASE_URL
    assert "HTTP 404" in result.message
    assert "remove the trailing slash" in result.message


def test_endpoint_path_in_base_url_is_diagnosed(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1/chat/completions"))
    assert result.outcome is Outcome.BAD_BASE_URL
    assert "must be the API root" in result.message


def test_missing_v1_is_diagnosed(server: str) -> None:
    result = check_profile(_profile(server))
    assert result.outcome is Outcome.BAD_BASE_URL
    assert "'/v1'" in result.message


def test_unknown_model_is_not_blamed_on_base_url(server: str) -> None:
    result = check_profile(_profile(f"{server}/v1", default_model="gpt-9"))
    assert result.outcome is Outcome.MODEL_NOT_FOUND
    assert "'gpt-9'" in result.message
    assert "does not exist" in result.message


def test_model_without_chat_template_is_diagnosed(server: str) -> None:
    result = check_profile(_profile(f"{server}/base-model/v1"))
    assert result.outcome is Outcome.NO_CHAT_TEMPLATE
    assert "--chat-template" in result.message


def test_connection_refused_is_diagnosed(closed_port: int) -> None:
    result = check_profile(_profile(f"http://127.0.0.1:{closed_port}/v1"))
    assert result.outcome is Outcome.CONNECTION_REFUSED
    assert f"127.0.0.1:{closed_port}" in result.message
    assert "Is the server running" in result.message


def test_slow_server_times_out(server: str) -> None:
    result = check_profile(_profile(f"{server}/slow/v1", timeout_secs=1))
    assert result.outcome is Outcome.TIMEOUT
    assert "timeout_secs=1" in result.message


def test_answer_without_choices_is_rejected(server: str) -> None:
    result = check_profile(_profile(f"{server}/html/v1"))
    assert result.outcome is Outcome.BAD_RESPONSE
    assert "no 'choices'" in result.message


def test_environment_proxy_is_ignored_for_profile_without_proxy(
    server: str, closed_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead proxy in the shell must not break a profile that says "no proxy".
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("no_proxy", "")
    assert check_profile(_profile(f"{server}/v1")).ok


# --- files and the active pointer -------------------------------------------------------------


def _add(tmp_path: Path, name: str, base_url: str, *extra: str) -> int:
    return gateway_main(
        ["--dir", str(tmp_path), "add", name, "--base-url", base_url, "--model", MODEL, *extra]
    )


def test_add_writes_private_toml_and_mirroring_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")  # `echo key > file`: the newline must not be stored
    assert _add(tmp_path, "local", "http://127.0.0.1:8100/v1", "--api-key-file", str(key_file)) == 0

    profile_dir = tmp_path / "local"
    assert stat.S_IMODE(profile_dir.stat().st_mode) == 0o700
    for name in ("config.toml", "settings.json"):
        assert stat.S_IMODE((profile_dir / name).stat().st_mode) == 0o600
    config = tomllib.loads((profile_dir / "config.toml").read_text())
    assert set(config) == {"api", "models", "proxy", "logging"}
    assert config["api"] == {
        "base_url": "http://127.0.0.1:8100/v1",
        "api_key": KEY,
        "timeout_secs": 60,
        "max_retries": 2,
    }
    assert config["models"] == {"default": MODEL, "coding": MODEL, "reasoning": MODEL}
    settings = json.loads((profile_dir / "settings.json").read_text())
    assert settings["local"]["baseUrl"] == config["api"]["base_url"]
    assert settings["local"]["apiKey"] == KEY
    assert settings["local"]["timeout"] == 60
    assert settings["local"]["retries"] == 2
    assert settings["editor"]["provider"] == "local"
    # The first profile becomes the active one.
    assert active_profile_name(tmp_path) == "local"


def test_use_switches_and_status_prints_base_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    assert _add(tmp_path, "local", "http://127.0.0.1:8100/v1") == 0
    assert _add(tmp_path, "remote", "https://llm.example.com/v1") == 0
    assert active_profile_name(tmp_path) == "local"

    assert gateway_main(["--dir", str(tmp_path), "use", "remote"]) == 0
    assert (tmp_path / "active").is_symlink()
    capsys.readouterr()
    assert gateway_main(["--dir", str(tmp_path), "status"]) == 0
    out = capsys.readouterr().out
    assert "active profile: remote" in out
    assert "base_url: https://llm.example.com/v1" in out
    assert "other profiles: local" in out


def test_use_of_unknown_profile_names_the_existing_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    _add(tmp_path, "local", "http://127.0.0.1:8100/v1")
    assert gateway_main(["--dir", str(tmp_path), "use", "prod"]) == 2
    err = capsys.readouterr().err
    assert "no profile 'prod'" in err
    assert "profiles: local" in err
    assert active_profile_name(tmp_path) == "local"


def test_add_refuses_to_overwrite_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    assert _add(tmp_path, "local", "http://127.0.0.1:8100/v1") == 0
    assert _add(tmp_path, "local", "http://127.0.0.1:9999/v1") == 2
    assert _add(tmp_path, "local", "http://127.0.0.1:9999/v1", "--force") == 0
    assert load_profile(tmp_path, "local").base_url == "http://127.0.0.1:9999/v1"


def test_add_without_key_says_where_to_put_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVTIER_GATEWAY_API_KEY", raising=False)
    assert _add(tmp_path, "local", "http://127.0.0.1:8100/v1") == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_add_warns_about_trailing_slash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    assert _add(tmp_path, "local", "http://127.0.0.1:8100/v1/") == 0
    assert "remove the trailing slash" in capsys.readouterr().err


def test_status_without_profiles_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gateway_main(["--dir", str(tmp_path), "status"]) == 1
    assert "no active profile" in capsys.readouterr().out


def test_unknown_key_in_config_is_rejected_with_suggestion(tmp_path: Path) -> None:
    profile_dir = tmp_path / "local"
    profile_dir.mkdir()
    (profile_dir / "config.toml").write_text(
        '[api]\nbase_url = "http://h/v1"\napi_key = "k"\ntimeout_sec = 5\n[models]\ndefault = "m"\n'
    )
    with pytest.raises(GatewayError, match="did you mean 'timeout_secs'"):
        load_profile(tmp_path, "local")


def test_wrong_type_in_config_is_rejected(tmp_path: Path) -> None:
    profile_dir = tmp_path / "local"
    profile_dir.mkdir()
    (profile_dir / "config.toml").write_text(
        '[api]\nbase_url = "http://h/v1"\napi_key = "k"\nmax_retries = "3"\n'
        '[models]\ndefault = "m"\n'
    )
    with pytest.raises(GatewayError, match=r"max_retries in .* must be an integer, got '3'"):
        load_profile(tmp_path, "local")


@pytest.mark.parametrize("value", ['quo"te', "back\\slash", "tab\tnew\nline\x7f", "ünï ☃ 🐍"])
def test_toml_writer_round_trips(value: str) -> None:
    profile = _profile("http://127.0.0.1:8100/v1", default_model=value, log_file=value)
    doc = tomllib.loads(profile_to_toml(profile))
    assert profile_from_toml("t", doc, "test") == profile


def test_test_command_reports_failure_on_stderr(
    tmp_path: Path,
    closed_port: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    _add(tmp_path, "down", f"http://127.0.0.1:{closed_port}/v1")
    assert gateway_main(["--dir", str(tmp_path), "test"]) == 1
    assert "FAILED (connection refused)" in capsys.readouterr().err


def test_test_command_ok_against_server(
    tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTIER_GATEWAY_API_KEY", KEY)
    _add(tmp_path, "up", f"{server}/v1")
    capsys.readouterr()
    assert gateway_main(["--dir", str(tmp_path), "test", "up"]) == 0
    assert capsys.readouterr().out.startswith("OK: model 'tiny' answered")
