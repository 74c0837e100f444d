"""Chat templates: reading a model's template(s), checking messages, and
rendering with a sandboxed jinja2 environment configured as transformers does.

Owns everything between a list of chat messages and the prompt string. Must
never tokenize (tokenizer.py does) nor import transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older names under which a message's reasoning arrives; templates read
# `reasoning_content` (DeepSeek, Qwen) or `thinking` (gpt-oss). transformers fills both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (bad roles, missing fields,
    or a template that does not parse)."""


def read_chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The model's chat template(s). As in transformers: template files
    (chat_template.jinja, additional_chat_templates/*.jinja) win over
    tokenizer_config.json; several templates become a dict by name."""
    templates: dict[str, str] = {}
    in_config = config.get("chat_template")
    if isinstance(in_config, str):
        templates["default"] = in_config
    elif isinstance(in_config, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({t["name"]: t["template"] for t in in_config})

    from_files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        from_files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            from_files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if from_files:
        templates = from_files

    if not templates:
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def validate_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Check the shape of a chat and return the copy the template sees.

    Like transformers, keys whose value is None are dropped (OpenAI clients send
    content=None next to tool_calls; templates handle a missing key better than a
    None), and reasoning under an older name is copied to the names templates read.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"got {type(messages).__name__}."
        )
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message.")
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' string (e.g. 'user').")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise ValueError(
                f"messages[{i}] (role {role!r}) has no 'content'; only an assistant "
                "message with tool_calls may leave it out."
            )
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{i}]['content'] must be a string or a list of content parts, "
                f"got {type(content).__name__}."
            )
        clean = {k: v for k, v in message.items() if v is not None}
        reasoning = next((clean[k] for k in _REASONING_FIELDS if k in clean), None)
        if reasoning is not None:
            clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
        chat.append(clean)
    return chat


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks in some templates; for inference it renders its body unchanged. Without
    this, such templates would not even parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    # Templates call this to reject a chat (e.g. roles not alternating).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ': wrong inside a prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template string. Templates come from model folders, that is
    from strangers: the immutable sandbox keeps them from touching Python objects.
    trim_blocks/lstrip_blocks are what transformers uses; templates are written
    for them."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"The chat template does not parse (line {e.lineno}): {e.message}"
        ) from e
