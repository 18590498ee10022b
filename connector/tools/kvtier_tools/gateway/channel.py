"""`kvtier gateway test`: a minimal chat completion through a profile, and what its failure
means (each :class:`Outcome` with the hint that fixes it)."""

from __future__ import annotations

import enum
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from kvtier_tools.gateway.profile import Profile, base_url_warnings


class Outcome(enum.Enum):
    """What `kvtier gateway test` found; each failure carries its own hint."""

    OK = "ok"
    KEY_WHITESPACE = "api key has whitespace"
    AUTH = "authentication failed"
    BAD_BASE_URL = "endpoint not found"
    MODEL_NOT_FOUND = "model not served"
    NO_CHAT_TEMPLATE = "model has no chat template"
    CONNECTION_REFUSED = "connection refused"
    UNKNOWN_HOST = "unknown host"
    TIMEOUT = "timeout"
    HTTP_ERROR = "HTTP error"
    BAD_RESPONSE = "not a chat completion"
    NETWORK_ERROR = "network error"


@dataclass(frozen=True)
class CheckResult:
    outcome: Outcome
    message: str
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def _server_message(body: bytes) -> str:
    """The error text of an OpenAI-style error body, else the start of the raw body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
    return text[:300]


def _opener(profile: Profile) -> urllib.request.OpenerDirector:
    # The profile, not the environment, decides the proxy: a stray http_proxy in the shell
    # would otherwise send requests for 127.0.0.1 to a proxy and make the test lie.
    host = urllib.parse.urlsplit(profile.base_url).hostname or ""
    bypass = {h.strip() for h in profile.no_proxy.split(",") if h.strip()}
    if profile.proxy_url and host not in bypass:
        proxies = {"http": profile.proxy_url, "https": profile.proxy_url}
    else:
        proxies = {}
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies))


def check_profile(profile: Profile) -> CheckResult:
    """Send a minimal chat completion and diagnose what users typically get wrong."""
    if profile.api_key != profile.api_key.strip() or any(c.isspace() for c in profile.api_key):
        return CheckResult(
            Outcome.KEY_WHITESPACE,
            f"api_key of profile '{profile.name}' contains whitespace (often a newline pasted "
            "with it or read from a file): remove it from config.toml",
        )
    # Tools concatenate base_url and the endpoint; so does this test, to see what they see.
    url = profile.base_url + "/chat/completions"
    payload = {
        "model": profile.default_model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
    }
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={
            "Authorization": f"Bearer {profile.api_key}",
            "Content-Type": "application/json",
        },
        method="POST",
    )
    start = time.monotonic()
    try:
        with _opener(profile).open(request, timeout=profile.timeout_secs) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        return _classify_http(profile, url, exc.code, exc.read(), time.monotonic() - start)
    except (urllib.error.URLError, OSError) as exc:
        return _classify_network(profile, exc, time.monotonic() - start)
    elapsed = time.monotonic() - start
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not doc["choices"]:
        return CheckResult(
            Outcome.BAD_RESPONSE,
            f"{url} answered HTTP 200 but not with a chat completion (no 'choices'): "
            f"is base_url an OpenAI-compatible API? Body starts: {body[:200]!r}",
            elapsed,
        )
    return CheckResult(
        Outcome.OK,
        f"model '{doc.get('model', profile.default_model)}' answered at {profile.base_url} "
        f"in {elapsed * 1000:.0f} ms",
        elapsed,
    )


def _classify_http(
    profile: Profile, url: str, code: int, body: bytes, elapsed: float
) -> CheckResult:
    said = _server_message(body)
    if code in (401, 403):
        return CheckResult(
            Outcome.AUTH,
            f"HTTP {code} from {url} ({said}): the server rejected the api_key. Check the key "
            "for stray whitespace (a space or newline pasted with it) and that it is the key "
            "the server was started with (vLLM: VLLM_API_KEY / --api-key)",
            elapsed,
        )
    if code == 404 and "model" in said.lower():
        return CheckResult(
            Outcome.MODEL_NOT_FOUND,
            f"the server does not serve model '{profile.default_model}' ({said}): set "
            "[models] default to a served model name (GET <base_url>/models lists them)",
            elapsed,
        )
    if code in (404, 405):
        hints = base_url_warnings(profile.base_url) or [
            f"base_url '{profile.base_url}' does not lead to an OpenAI-compatible API"
        ]
        return CheckResult(Outcome.BAD_BASE_URL, f"HTTP {code} from {url}: {hints[0]}", elapsed)
    if code == 400 and "chat template" in said.lower():
        # vLLM refuses chat completions for a model whose tokenizer has no chat template.
        return CheckResult(
            Outcome.NO_CHAT_TEMPLATE,
            f"HTTP 400 from {url}: the served model has no chat template ({said}). Start the "
            "server with --chat-template FILE, or serve an instruct model that ships one",
            elapsed,
        )
    return CheckResult(Outcome.HTTP_ERROR, f"HTTP {code} from {url}: {said}", elapsed)


def _classify_network(profile: Profile, exc: BaseException, elapsed: float) -> CheckResult:
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    where = urllib.parse.urlsplit(profile.base_url).netloc
    if isinstance(reason, ConnectionRefusedError):
        return CheckResult(
            Outcome.CONNECTION_REFUSED,
            f"connection refused by {where}: nothing listens there. Is the server running, "
            "and are host and port in base_url right?",
            elapsed,
        )
    if isinstance(reason, socket.gaierror):
        return CheckResult(
            Outcome.UNKNOWN_HOST,
            f"cannot resolve the host of base_url ({where}): {reason}",
            elapsed,
        )
    if isinstance(reason, TimeoutError):
        return CheckResult(
            Outcome.TIMEOUT,
            f"no answer from {where} within timeout_secs={profile.timeout_secs}: the server is "
            "overloaded, still loading the model, or a firewall drops the packets",
            elapsed,
        )
    return CheckResult(Outcome.NETWORK_ERROR, f"cannot reach {where}: {reason}", elapsed)
