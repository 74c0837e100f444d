"""RequestState: what the engine keeps beside the scheduler's Request, and
the RequestOutputs it makes of it.

Owns a request's text, logprobs and prompt logprobs as they grow, what of
them its earlier outputs already carried, and the three output kinds
(sampling_params.RequestOutputKind, vLLM's):

  * CUMULATIVE: every output carries everything so far (copies of the lists:
    an output handed out never changes afterwards).
  * DELTA: every output carries what is new since the request's last output:
    token ids, text, logprobs; prompt logprobs only on the first;
    cumulative_logprob stays the running sum, and the prompt fields are on
    every output. Joining the deltas gives the CUMULATIVE output's fields.
    With stop strings, text that may be the start of one is held back until
    the next token decides (a stop string cuts the text where it starts, so
    nothing sent can be taken back); the finished output flushes it.
  * FINAL_ONLY: one output, when the request finishes (the engine skips the
    others).

Never decides when a request stops or what its text is (the engine's
detokenizer and stop checks do); it only reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyengine.detokenizer import IncrementalDetokenizer, stop_string_holdback
from tinyengine.outputs import CompletionOutput, Logprob, RequestOutput
from tinyengine.sampling_params import RequestOutputKind
from tinyengine.scheduling.request import Request


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs are on
    # Per prompt token (entry 0, the first token's, is None); filled as the
    # prompt's chunks are computed (worker/prompt_logprobs.py).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA: how much of the token ids and text earlier outputs carried, and
    # whether the prompt logprobs went out.
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt_logprobs: bool = False

    @property
    def final_only(self) -> bool:
        return self.kind is RequestOutputKind.FINAL_ONLY

    def make_output(self) -> RequestOutput:
        """The request's output now, of its kind (module docstring)."""
        request = self.request
        finished = request.is_finished
        token_ids: list[int] = request.output_token_ids
        text, logprobs, prompt_logprobs = self.text, self.logprobs, self.prompt_logprobs
        if self.kind is RequestOutputKind.DELTA:
            params = request.sampling_params
            end = len(text)
            if not finished and params.stop and not params.include_stop_str_in_output:
                end -= stop_string_holdback(text, params.stop)
            end = max(end, self.sent_chars)
            text, self.sent_chars = text[self.sent_chars : end], end
            first = self.sent_tokens
            token_ids, self.sent_tokens = token_ids[first:], len(token_ids)
            if logprobs is not None:
                logprobs = logprobs[first:]
            if self.sent_prompt_logprobs:
                prompt_logprobs = None
            self.sent_prompt_logprobs = True
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
            prompt_logprobs = list(prompt_logprobs) if prompt_logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=request.finish_reason,
            logprobs=logprobs,
            stop_reason=request.stop_reason,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
        )
