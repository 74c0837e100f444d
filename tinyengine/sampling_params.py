"""SamplingParams: how one request wants its tokens chosen and when it stops.

Owns validation of user-facing sampling fields (a bad value raises ValueError
naming the field). Must never import torch: the scheduler reads these too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

# vLLM caps the number of logprobs a request may ask for; we do the same so a
# request cannot make the sampler sort the whole vocabulary every step.
MAX_LOGPROBS = 20
# Stop strings a request may give, and their length (OpenAI allows 4; vLLM
# sets no bound, which lets one request slow every step of the engine loop).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024


class RequestOutputKind(Enum):
    """Which outputs `LLMEngine.step` returns for a request (vLLM's names).

    CUMULATIVE: one per new token, with all text and tokens so far (the
    default; streaming reads it). DELTA: one per new token, with only what
    is new since the last one (text that may start a stop string is held
    back until the next token decides; tinyengine/request_state.py).
    FINAL_ONLY: only the finished output, which is all `LLM.generate` needs;
    the engine then skips building an output per token and, without stop
    strings, decodes the text once at the end instead of incrementally (the
    same string: see the detokenizer's invariant).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options (a subset of vLLM's).

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k, top_p 1.0
    disables top-p, min_p 0 disables min-p. `logprobs=N` returns, for every
    generated token, the log-probabilities of the sampled token and the top N
    tokens of the model's (unmodified) distribution.
    """

    n: int = 1  # completions per prompt (LLM.generate and the server fan them out)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # Penalties on tokens already seen (worker/penalties.py has the maths):
    # vLLM's ranges; 0, 0 and 1 switch them off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> value added to its logit (OpenAI's logit_bias; -100 bans it).
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token (the first has none): its logprob and the top N of the
    # distribution the model gave it (vLLM's prompt_logprobs). Such a request
    # computes its whole prompt (no prefix-cache hit: a cached block has no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict = field(default_factory=dict, repr=False)
    # Set by __post_init__ (the sampler asks for every row every step, so
    # plain attributes, not properties): a penalty is on; the logits change
    # before the draw at all (a penalty or a logit bias).
    has_penalties: bool = field(init=False, repr=False, compare=False, default=False)
    adjusts_logits: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self.has_penalties = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )
        self.adjusts_logits = self.has_penalties or bool(self.logit_bias)

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 1e4:
            raise bad("repetition_penalty", "must be a number > 0 (1 = off)")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(_is_int(t) and t >= 0 for t in self.logit_bias)
            and all(_is_number(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values())
        ):
            raise bad("logit_bias", "must map token ids (ints >= 0) to numbers in [-100, 100]")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            # torch.Generator.manual_seed takes [-2^63, 2^64); int64 (vLLM's
            # bound) leaves room for the seed + i of n > 1's completions.
            raise bad("seed", "must be an integer in [-2^63, 2^63) or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 (or None for 'up to max_model_len')")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        # Every stop is searched for in every step's new text: bounded, so one
        # request cannot slow the engine loop everyone shares.
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(
                f"SamplingParams.stop takes at most {MAX_STOP_STRINGS} strings of at most "
                f"{MAX_STOP_CHARS} characters each, got {len(self.stop)} strings, the longest "
                f"{max(map(len, self.stop))} characters"
            )
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")

    def fan_out(self) -> list[SamplingParams]:
        """The n one-sequence requests that serve n completions of a prompt
        (the engine runs one sequence per request; the prefix cache shares the
        prompt's KV blocks among them). Completion i of a seeded request uses
        seed + i (wrapped into int64): reproducible, and completion 0 equals
        the n=1 result."""
        if self.n == 1:
            return [self]
        return [
            replace(self, n=1, seed=None if self.seed is None else _wrap_int64(self.seed + i))
            for i in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
