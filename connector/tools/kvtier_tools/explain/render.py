"""Token ids as the served model makes them, and text back from them.

- :class:`ServerRenderer`: the running vLLM itself, the most faithful (its tokenizer, its chat
  template, its options). vLLM 0.32 serves ``POST /tokenize`` with ``{"model", "prompt",
  "add_special_tokens"}`` (completions; special tokens added by default) or ``{"model",
  "messages", "add_generation_prompt", ...}`` (chat, template applied server side; no extra
  special tokens by default) and answers ``{"tokens": [...], "count": n, ...}``;
  ``POST /detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt": text}``
  (``vllm/entrypoints/serve/tokenize/``). Neither path is under ``/v1``.
- :class:`LocalRenderer`: the model directory, offline. With ``transformers`` importable (the
  serving venv has it): its tokenizer, and the chat template rendered to text then tokenized
  without extra special tokens, as vLLM does. Without it: ``tokenizers`` and tokenizer.json,
  completions prompts only.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from kvtier_tools.explain.prompts import ExplainError, Prompt


class Renderer(Protocol):
    description: str

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def render(renderer: Renderer | None, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` (given ones as they are)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if renderer is None:
        raise ExplainError(
            f"{prompt.label}: text needs the model's tokenizer: pass --server-url (the running "
            "vLLM) or --model-dir"
        )
    return renderer.tokenize(prompt)


class ServerRenderer:
    """``/tokenize`` and ``/detokenize`` of a running vLLM (see the module docstring)."""

    def __init__(self, url: str, model: str | None, api_key: str | None) -> None:
        self.base = url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.model = model or self._served_model()
        self.description = f"{self.base}/tokenize (model {self.model})"

    def _request(self, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            hint = " (pass --api-key-file)" if exc.code == 401 else ""
            raise ExplainError(f"{self.base}{path}: HTTP {exc.code}{hint}: {detail}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ExplainError(f"{self.base}{path}: {exc} (is the server up?)") from exc

    def _served_model(self) -> str:
        data = self._request("/v1/models", None).get("data") or []
        if not data:
            raise ExplainError(f"{self.base}/v1/models lists no model: pass --model")
        return str(data[0]["id"])

    def tokenize(self, prompt: Prompt) -> list[int]:
        body: dict[str, Any] = {"model": self.model, **prompt.options}
        if prompt.messages is not None:
            body["messages"] = list(prompt.messages)
        else:
            body["prompt"] = prompt.text
            body = {k: v for k, v in body.items() if k in ("model", "prompt", "add_special_tokens")}
        return [int(t) for t in self._request("/tokenize", body)["tokens"]]

    def decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return str(
            self._request("/detokenize", {"model": self.model, "tokens": token_ids})["prompt"]
        )


class LocalRenderer:
    """The model directory's tokenizer (see the module docstring)."""

    def __init__(self, model_dir: str) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.dir = Path(model_dir)
        self._tok: Any = None
        self._hf: Any = _transformers_tokenizer(self.dir)
        if self._hf is not None:
            self.description = f"{self.dir} (transformers: tokenizer and chat template)"
            return
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ExplainError(
                "--model-dir needs `transformers` or `tokenizers` in this venv (the vLLM venv "
                "has both): install one, or pass --server-url"
            ) from exc
        path = self.dir / "tokenizer.json"
        if not path.is_file():
            raise ExplainError(f"--model-dir {model_dir}: no tokenizer.json there")
        self._tok = Tokenizer.from_file(str(path))
        # Measured with the tiny model: the plain tokenizer splits a 9,000-word text into 38
        # tokens fewer than transformers' (what vLLM uses): say so, do not pass it off as vLLM's.
        self.description = (
            f"{path} (tokenizers only: transformers is not installed here, so the token ids can "
            "differ from what vLLM computes; run from the vLLM venv or pass --server-url)"
        )

    def tokenize(self, prompt: Prompt) -> list[int]:
        special = prompt.options.get("add_special_tokens")
        if prompt.messages is None:
            add = True if special is None else bool(special)
            if self._hf is not None:
                return list(self._hf(prompt.text, add_special_tokens=add)["input_ids"])
            return list(self._tok.encode(prompt.text, add_special_tokens=add).ids)
        if self._hf is None:
            raise ExplainError(
                f"{prompt.label}: a chat request needs the model's chat template, which needs "
                "`transformers` (not installed here): pass --server-url, or run this from the "
                "vLLM venv"
            )
        kwargs = dict(prompt.options.get("chat_template_kwargs") or {})
        for key in ("add_generation_prompt", "continue_final_message", "tools", "chat_template"):
            if key in prompt.options:
                kwargs[key] = prompt.options[key]
        kwargs.setdefault("add_generation_prompt", True)
        text = self._hf.apply_chat_template(list(prompt.messages), tokenize=False, **kwargs)
        return list(self._hf(text, add_special_tokens=bool(special))["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        tok = self._hf if self._hf is not None else self._tok
        return str(tok.decode(token_ids, skip_special_tokens=False))


def _transformers_tokenizer(model_dir: Path) -> Any:
    """The directory's tokenizer through transformers, or None when it is not installed."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ExplainError(f"--model-dir {model_dir}: no tokenizer there ({exc})") from exc
