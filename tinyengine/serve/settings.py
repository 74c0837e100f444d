"""ServerSettings: what the server needs to know before it starts, read from
environment variables (for `uvicorn server:app`) or the CLI (`python -m
tinyengine serve`).

Owns the mapping `TINYENGINE_<FIELD>` -> EngineConfig field (every field, by
its type: ints, floats, booleans, JSON for dicts and lists, "none" for an
optional field) and the server's own variables. Must never start anything;
it validates early so that a typo fails at startup, not at the first request.

    TINYENGINE_MODEL              a model folder or a preset name (default deepseek-v4-tiny)
    TINYENGINE_SERVED_MODEL_NAME  the name clients use (default: preset or folder name)
    TINYENGINE_API_KEY            require `Authorization: Bearer <key>` (not on /health)
    TINYENGINE_MAX_REQUEST_BYTES  request body limit; larger bodies get 413 (default 4 MiB)
    TINYENGINE_MAX_N              the largest `n` one request may ask for (default 128, OpenAI's)
    TINYENGINE_MAX_REQUEST_SEQUENCES  the most sequences one request may fan out to,
                                  prompts x n (default 4096); above it, 400
    TINYENGINE_<FIELD>            any EngineConfig field, e.g. TINYENGINE_MAX_NUM_SEQS=8
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinyengine.config import EngineConfig
from tinyengine.models_presets import DEFAULT_MODEL, served_model_name

ENV_PREFIX = "TINYENGINE_"
# The server's own variables, and those other parts of tinyengine read.
_SERVER_VARS = {ENV_PREFIX + n for n in ("MODEL", "SERVED_MODEL_NAME", "API_KEY",
                                         "MAX_REQUEST_BYTES", "MAX_N",
                                         "MAX_REQUEST_SEQUENCES")}  # fmt: skip
_OTHER_VARS = {ENV_PREFIX + n for n in ("CACHE", "BUILD_DEVICE")}

logger = logging.getLogger("tinyengine.server")
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_MAX_N = 128  # OpenAI's limit on `n`
# Enough for a 32-prompt batch at n=128; one request beyond it would keep
# the engine busy for minutes, and admission is fair, not preemptive-free.
DEFAULT_MAX_REQUEST_SEQUENCES = 4096
# The server's own integer limits (each >= 1): field -> default.
_LIMITS = {
    "max_request_bytes": DEFAULT_MAX_REQUEST_BYTES,
    "max_n": DEFAULT_MAX_N,
    "max_request_sequences": DEFAULT_MAX_REQUEST_SEQUENCES,
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass
class ServerSettings:
    model: str = DEFAULT_MODEL  # folder or preset name
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_n: int = DEFAULT_MAX_N
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES

    def __post_init__(self) -> None:
        for name in _LIMITS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # Fails now, naming the option, rather than later inside the engine thread.
        EngineConfig.from_kwargs(self.model, **self.engine_kwargs)

    @property
    def model_name(self) -> str:
        return self.served_model_name or served_model_name(self.model)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + n.upper() for n in engine_option_types()} | _SERVER_VARS | _OTHER_VARS
        for var in sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known):
            # vLLM warns about unknown VLLM_* variables too: a typo or an
            # option tinyengine lacks (e.g. ..._KV_CACHE_DTYPE) changes nothing.
            logger.warning("%s is not a tinyengine setting; it is ignored", var)
        kwargs: dict[str, Any] = {}
        for name, tp in engine_option_types().items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                kwargs[name] = parse_option(ENV_PREFIX + name.upper(), raw, tp)
        limits = {}
        for name, default in _LIMITS.items():
            var = ENV_PREFIX + name.upper()
            limits[name] = parse_option(var, env[var], int) if env.get(var) else default
        return cls(
            model=env.get(ENV_PREFIX + "MODEL") or DEFAULT_MODEL,
            engine_kwargs=kwargs,
            served_model_name=env.get(ENV_PREFIX + "SERVED_MODEL_NAME") or None,
            api_key=env.get(ENV_PREFIX + "API_KEY") or None,
            **limits,
        )


def engine_option_types() -> dict[str, Any]:
    """EngineConfig field name -> its type, for every field but `model`."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def parse_option(name: str, raw: str, tp: Any) -> Any:
    """Parse a string (an env var or a CLI flag) into a value of type `tp`."""
    members = typing.get_args(tp) if _is_union(tp) else (tp,)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    text = raw.strip()
    if optional and text.lower() in ("", "none", "null"):
        return None
    kind = typing.get_origin(members[0]) or members[0]
    try:
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"expected one of {_TRUE + _FALSE}")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind in (dict, list):
            value = json.loads(text)
            if not isinstance(value, kind):
                raise ValueError(f"expected a JSON {kind.__name__}")
            return value
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not a valid {_type_name(tp)}: {e}") from None
    return raw


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    members = typing.get_args(tp) if _is_union(tp) else (tp,)
    names = [getattr(m, "__name__", str(m)) for m in members if m is not type(None)]
    return " or ".join(names)
