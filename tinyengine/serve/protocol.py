"""The OpenAI wire format, inbound: request bodies, their validation, and errors.

Owns: the request models of /v1/completions and /v1/chat/completions (the
fields OpenAI clients send, plus vLLM's extras such as `stop_token_ids` and
`ignore_eos`), turning a body into a model or an `APIError` that names the
offending field, turning a request into SamplingParams, and the error body
`{"error": {"message", "type", "param", "code"}}`.

Must never: touch the engine, or accept a field it cannot honour silently (a
request with a suffix or a JSON response_format is refused, not ignored). Unknown fields
are ignored, as OpenAI clients send fields (`user`, ...) a server may not use.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tinyengine.sampling_params import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error the server answers with, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


# --- request models ---


class Strict(BaseModel):
    # strict: "5" is not an integer and 1 is not a boolean, as OpenAI's own API
    # would say; extra="ignore": clients send fields we do not use;
    # allow_inf_nan=False: JSON bodies may spell NaN and Infinity, and no float
    # field (temperature, penalties, logit_bias values...) means anything by them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


# vLLM's request extras that change what is generated and that tinyengine
# does not implement: refused with a 400 naming the field, not dropped like
# other unknown fields (a client relying on one would get unconstrained text).
UNSUPPORTED_EXTRAS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "allowed_token_ids", "bad_words", "logits_processors", "use_beam_search",
    "truncate_prompt_tokens", "prompt_logprobs", "chat_template", "continue_final_message",
    "return_tokens_as_token_ids",
)  # fmt: skip


class _SamplingRequest(Strict):
    """Fields both endpoints share."""

    # Unknown fields are kept (model_extra) so check_supported can refuse the
    # UNSUPPORTED_EXTRAS; the rest are ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    # Completions per prompt (fanned out); capped by the server's settings
    # (max_n, max_request_sequences), checked in checks.check_fan_out.
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    # Only {"type": "text"}: json_object / json_schema need guided decoding.
    response_format: dict[str, Any] | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        for name in UNSUPPORTED_EXTRAS:
            if (self.model_extra or {}).get(name) is not None:
                raise bad_request(f"{name} is not supported by tinyengine", name)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad_request(
                f"response_format {self.response_format.get('type')!r} is not supported: "
                "tinyengine has no guided (JSON-constrained) decoding; use {'type': 'text'}",
                "response_format",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias keys are token ids written as strings."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError as e:
            raise bad_request(
                f"logit_bias keys must be token ids (integers as strings): {e}", "logit_bias"
            ) from e

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n or 1,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=self._logit_bias(),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            match = re.match(r"SamplingParams\.(\w+)", str(e))
            raise bad_request(str(e), match.group(1) if match else None) from e


class CompletionRequest(_SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked by hand in
    # `prompts()` for an error message that says which shapes are allowed.
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # null means false (OpenAI and vLLM accept it)
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(f"best_of={self.best_of} must be >= n={self.n}", "best_of")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of={self.best_of} is not supported: only best_of == n (no ranking)",
                "best_of",
            )

    def prompts(self) -> list[str | dict[str, Any]]:
        """The prompts as engine inputs: text, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = p
        else:
            items = []
        prompts: list[str | dict[str, Any]] = []
        for item in items:
            if isinstance(item, str) and item:
                prompts.append(item)
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                prompts.append({"prompt_token_ids": list(item)})
            else:
                items = []
                break
        if not items:
            raise bad_request(
                "prompt must be a non-empty string, a list of non-empty strings, a list of "
                "token ids, or a list of non-empty token-id lists",
                "prompt",
            )
        return prompts

    def sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens come with logprobs too (vLLM's way;
            # what lm-eval-harness's loglikelihood requests read).
            params.prompt_logprobs = self.logprobs
        return params


# The roles chat templates know; any other is refused rather than rendered
# however a template happens to treat an unknown role.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatMessage(BaseModel):
    # Extra fields (name, tool_calls, reasoning_content, ...) reach the template.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role {role!r} is not supported; use one of {', '.join(CHAT_ROLES)}")
        return role

    def text_length(self) -> int:
        """Characters of text this message contributes (the prompt-size bound)."""
        if isinstance(self.content, str):
            return len(self.content)
        parts = self.content or []
        return sum(len(p["text"]) for p in parts if isinstance(p.get("text"), str))


# Arguments of apply_chat_template, not variables of the template: a request
# may not replace the model's template (a template is code the server runs)
# nor change how the render is returned.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "add_generation_prompt", "messages", "conversation", "tools",
    "documents", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "processor_kwargs",
})  # fmt: skip


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)  # None: up to max_model_len
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name
    logprobs: bool | None = False  # null means false
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools reach the chat template only with tool_choice "none": nothing
    # parses tool calls out of the output (vLLM needs a tool-call parser too).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        if self.tools and self.tool_choice != "none":
            raise bad_request(
                "tool calling is not supported (no tool-call parser); send tool_choice "
                "'none' to render the tools into the prompt only, or leave tools out",
                "tool_choice",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        reserved = sorted(set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs.{reserved[0]}: not a template variable a request may "
                "set (the server renders with the model's own template; messages, tools and "
                "add_generation_prompt are fields of the request)",
                "chat_template_kwargs",
            )

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# --- parsing ---

RequestT = TypeVar("RequestT", bound=_SamplingRequest)


def parse_request(body: bytes, cls: type[RequestT]) -> RequestT:
    """Body bytes -> a validated generation request whose fields the engine can
    all honour, or an APIError naming what is wrong."""
    request = parse_body(body, cls)
    request.check_supported()
    return request


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_body(body: bytes, cls: type[ModelT]) -> ModelT:
    """Body bytes -> a validated `cls`, or an APIError naming what is wrong."""
    body = body.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark: JSON may ignore it
    try:
        data = json.loads(body)
    except RecursionError as e:  # ~1000 nested arrays: json's parser recurses
        raise bad_request(_TOO_DEEP) from e
    except ValueError as e:  # not JSON, not UTF-8, or an integer of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid" and "recursion limit" in err["msg"]:
            # pydantic's parser stops at a shallower nesting than Python's json.
            raise bad_request(_TOO_DEEP) from e
        if err["type"] == "json_invalid" and (param := _surrogate_field(data)) is not None:
            # Python's json read it, pydantic's (strict UTF-8) did not: a lone
            # surrogate escape such as "\ud800", which is no Unicode character.
            raise bad_request(
                f"{param}: the text is not valid Unicode: it holds a lone surrogate escape "
                "(such as \\ud800); send characters outside the BMP as a surrogate pair "
                "or as UTF-8",
                param,
            ) from e
        # Drop the union-member tags pydantic puts in a location ("stop.str").
        loc = [str(part) for part in err["loc"] if not _is_type_tag(part)]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "the request body"
        message = _MESSAGES.get(err["type"], err["msg"])
        if err["type"] == "value_error":  # our validators' own words, without pydantic's prefix
            message = str(err.get("ctx", {}).get("error", message))
        raise bad_request(f"{where}: {message}", param) from e


_TOO_DEEP = "the request body nests JSON arrays/objects too deeply"
_MESSAGES = {"missing": "field required", "finite_number": "must be a finite number"}


def _surrogate_field(data: dict[str, Any]) -> str | None:
    """The top-level field whose text holds a lone surrogate, if any."""
    return next((key for key, value in data.items() if _has_surrogate(value)), None)


def _has_surrogate(value: object) -> bool:
    """Whether any string in `value` holds a lone surrogate; walked with a
    stack, not recursion: json.loads takes nesting deeper than Python's
    recursion limit allows a recursive walk."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "list", "dict") or "[" in part
    )
