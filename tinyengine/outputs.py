"""What LLM.generate and the engine return: RequestOutput, CompletionOutput, Logprob.

Plain data, shaped like vLLM's so code written against vLLM reads the same;
`RequestOutput.add` joins DELTA outputs (sampling_params.RequestOutputKind).
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

    def add(self, later: RequestOutput) -> None:
        """Append a later DELTA output of the same request (vLLM's
        RequestOutput.add), in place: text, token ids and logprobs extend,
        the rest is the later one's. Then self is the delta of both, or, if
        self was the request's first output, everything so far (the
        CUMULATIVE output's fields)."""
        for mine, theirs in zip(self.outputs, later.outputs, strict=True):
            mine.text += theirs.text
            mine.token_ids.extend(theirs.token_ids)
            if mine.logprobs is not None and theirs.logprobs is not None:
                mine.logprobs.extend(theirs.logprobs)
            mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
            mine.cumulative_logprob = theirs.cumulative_logprob
        self.finished = later.finished
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
