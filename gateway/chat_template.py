"""The model's chat template, rendered like HF transformers' `apply_chat_template` (jinja2 only, no torch)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

from pdmesh.errors import InvalidRequest

_NO_TEMPLATE = "the model has no chat template"


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self._template = _compile(source) if source else None
        self._special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """Reads tokenizer_config.json; a chat_template.jinja file beside it wins, as in transformers."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        jinja_file = model_dir / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.exists() else _template_source(config.get("chat_template"))
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; InvalidRequest when there is no template or it rejects them."""
        if self._template is None:
            raise InvalidRequest(_NO_TEMPLATE)
        try:
            return self._template.render(messages=[_flatten_content(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template failed on these messages: {exc}") from exc


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise InvalidRequest(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (jinja2's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_source(chat_template: str | list | None) -> str | None:
    """A config's template: the string itself, or from a list of named ones the "default"."""
    if isinstance(chat_template, list):
        named = {entry["name"]: entry["template"] for entry in chat_template}
        return named.get("default")
    return chat_template


def _token_text(token: str | dict | None) -> str:
    """A special token as configs write it: a string, or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def _flatten_content(message: dict) -> dict:
    """The message with its content as one string: text parts joined by newlines (as vLLM does)."""
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    return {**message, "content": "\n".join(_part_text(part) for part in content)}


def _part_text(part: dict) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequest(f"unsupported message content part {kind!r}: only text parts are supported")
    return part["text"]
