"""The engine's way in: from a prompt and its SamplingParams to token ids and
the max_tokens the engine can honour.

Owns which tokenizer an engine uses and which token ids end its requests, the
prompt forms (text, or `{"prompt_token_ids": [...]}`) and their tokenization,
and the checks of one request against the engine's limits: context length,
vocabulary, logit_bias ids, stop strings without a tokenizer, max_tokens.

Must never: touch the scheduler or the runner, or keep anything about a
request (the engine does, once every check has passed). A refusal is an
`InvalidRequestError` naming the field at fault (the server's 400) or a
ValueError that says what to do, never a bare assert.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tinyengine.config import EngineConfig
from tinyengine.sampling_params import SamplingParams
from tinyengine.tokenizer import Tokenizer, load_tokenizer_if_present

PromptType = str | dict[str, Any]


class InvalidRequestError(ValueError):
    """add_request's refusal of one request; `param` names the request field
    at fault (the server's 400 reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load_engine_tokenizer(
    config: EngineConfig, hf_config: dict[str, Any]
) -> tuple[Tokenizer | None, frozenset[int]]:
    """The engine's tokenizer (None when the model folder has none) and the
    token ids that end its requests."""
    if config.tokenizer is not None:  # asked for: it must be there (vLLM fails too)
        tokenizer = load_tokenizer_if_present(config.tokenizer)
        if tokenizer is None:
            raise ValueError(
                f"EngineConfig.tokenizer={config.tokenizer!r}: no tokenizer files there"
            )
    else:
        tokenizer = load_tokenizer_if_present(config.model)
    eos_token_ids = frozenset(
        tokenizer.eos_token_ids
        if tokenizer is not None
        else _eos_token_ids_from_config(config.model, hf_config)
    )
    return tokenizer, eos_token_ids


def tokenize_prompt(
    tokenizer: Tokenizer | None, prompt: PromptType
) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids)."""
    if isinstance(prompt, str):
        return prompt, _encode(tokenizer, prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], _encode(tokenizer, prompt["prompt"])
    raise ValueError(
        f"a prompt must be a string or a dict with 'prompt_token_ids' (or 'prompt'), "
        f"got {type(prompt).__name__}"
    )


def _encode(tokenizer: Tokenizer | None, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(
            "this model folder has no tokenizer files; pass prompts as {'prompt_token_ids': [...]}"
        )
    return tokenizer.encode(text)


@dataclass(frozen=True)
class RequestLimits:
    """What one request is checked against: fixed once the engine is built."""

    max_model_len: int
    vocab_size: int
    cache_tokens: int  # what the KV cache holds: num_kv_blocks * block_size
    has_tokenizer: bool

    def max_tokens(
        self, token_ids: list[int], params: SamplingParams, strict_max_tokens: bool
    ) -> int:
        """Check the request and return the max_tokens it gets. A max_tokens
        that overshoots max_model_len is cut to the room left (as vLLM's
        offline LLM does), or, with strict_max_tokens, refused (the OpenAI
        server's rule, as vLLM's)."""
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}; it must leave room for at least one output token",
                "prompt",
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                "prompt",
            )
        outside = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias token ids {outside[:5]} are outside the vocabulary "
                f"[0, {self.vocab_size})",
                "logit_bias",
            )
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer, and this model folder has none")
        room = self.max_model_len - len(token_ids)
        if strict_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {len(token_ids)} "
                f"input tokens ({params.max_tokens} > {self.max_model_len} - {len(token_ids)})",
                "max_tokens",
            )
        if params.max_tokens is None:
            # "Up to the context": what the KV cache can hold bounds it too,
            # when the cache is smaller than max_model_len (if even the prompt
            # does not fit, the scheduler's check in add_request says so).
            return max(1, min(room, self.cache_tokens - len(token_ids)))
        return min(params.max_tokens, room)


def _eos_token_ids_from_config(model_path: str, hf_config: dict[str, Any]) -> set[int]:
    """Without tokenizer files, eos comes from config.json / generation_config.json."""
    ids: set[int] = set()
    sources = [hf_config]
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f))
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(t) for t in eos)
    return ids
