"""What LLM.generate and the engine return: RequestOutput, CompletionOutput, Logprob.

Plain data, shaped like vLLM's so code written against vLLM reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one step, its rank in the distribution
    (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: SampleLogprobs | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # Sum of the sampled tokens' logprobs; None unless logprobs were requested
    # (vLLM's rule: they are only computed then).
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, None for the first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
