"""The sampler's results on their way to the host: `PendingSample` (a
launched sample: token ids on the device now, the host copy later),
`SamplerOutput` (what the engine reads: token ids and logprobs per row), and
`StepLaunch` (what `ModelRunner.launch` returns for one step).

Owns the packing contract with `Sampler._collect`: everything a step's
sampling produced travels in ONE device->host copy into pinned memory,
started when sampling is launched and waited for only in `result()` -- the
step's single synchronization point. Layout of that copy, for R rows of
which L ask for logprobs with at most N top entries each:
  [token_ids (R) | chosen ids, logprobs, ranks (3 x L) | top ids, top
   logprobs, top ranks (3 x L x N)]   (just the R token ids when L = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TokenLogprob = tuple[int, float, int]  # (token_id, logprob, rank); rank 1 = most likely
# A step's prompt logprobs (worker/prompt_logprobs.py), by request id: the index
# of the first prompt token the rows cover, and one row per prompt token.
PromptLogprobRows = dict[str, tuple[int, list[list[TokenLogprob]]]]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: None (not asked for), or [(token_id, logprob, rank), ...] with the
    # sampled token first, then the top N (N = params.logprobs) in descending
    # order. The sampled token may appear twice, as in vLLM.
    logprobs: list[list[TokenLogprob] | None]


def ranked_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[torch.Tensor]:
    """log_softmax of `logits` [R, V] (in fp32), then per row the logprob and
    rank of `tokens` [R] ([R, 1] each) and, when n > 0, the top n as ids,
    logprobs and ranks ([R, n] each, descending). rank = 1 + the number of
    strictly greater logprobs, so ties share a rank. The sampler's logprobs
    and the prompt logprobs both rank this way."""
    logprobs = logits.float().log_softmax(dim=-1)  # no-op .float() for fp32
    chosen_lp = logprobs.gather(1, tokens[:, None])
    chosen_rank = (logprobs > chosen_lp).sum(dim=-1, keepdim=True) + 1
    if not n:
        return [chosen_lp, chosen_rank]
    top_lp, top_ids = logprobs.topk(n, dim=-1)  # sorted descending
    # Anything strictly greater than a top-n value is itself in the top n, so
    # an n x n comparison ranks them (no second pass over the vocabulary).
    top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(dim=-1) + 1
    return [chosen_lp, chosen_rank, top_ids, top_lp, top_rank]


def to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start x's device->host copy; the event marks its end (None on CPU)."""
    if x.device.type != "cuda":
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class PendingSample:
    """A launched sampling step: the ids on the device now, the host results
    (`result()`) once the copy started by the sampler has landed."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        host: tuple[torch.Tensor, torch.cuda.Event | None],
        num_rows: int,
        rows: list[int],
        wanted: list[int],
        n: int,
    ) -> None:
        self.token_ids = token_ids  # [num_rows] on the device, for the next step's inputs
        self._host, self._done = host
        self._num_rows, self._rows, self._wanted, self._n = num_rows, rows, wanted, n
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """Wait for the copy (the step's only sync) and unpack it, once."""
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            self._result = self._unpack(self._host.tolist())
        return self._result

    def _unpack(self, host: list) -> SamplerOutput:
        num_rows, rows, n = self._num_rows, self._rows, self._n
        if not rows:
            return SamplerOutput(token_ids=[int(x) for x in host], logprobs=[None] * num_rows)
        num_lp = len(rows)
        token_ids = [int(x) for x in host[:num_rows]]
        fields = [host[num_rows + k * num_lp : num_rows + (k + 1) * num_lp] for k in range(3)]
        top = host[num_rows + 3 * num_lp :]
        out: list[list[TokenLogprob] | None] = [None] * num_rows
        for j, i in enumerate(rows):
            entries = [(int(fields[0][j]), fields[1][j], int(fields[2][j]))]
            for m in range(self._wanted[j]):
                at = j * n + m
                entries.append((int(top[at]), top[num_lp * n + at], int(top[2 * num_lp * n + at])))
            out[i] = entries
        return SamplerOutput(token_ids=token_ids, logprobs=out)


class StepLaunch:
    """A launched step: `result()` waits for its sampled tokens (one per
    scheduled request, None where the chunk does not reach its end) and the
    sampler output (for logprobs), in the order of `plan.scheduled`;
    `prompt_logprobs` holds the rows of the prompt positions it computed for
    requests that asked (worker/prompt_logprobs.py), already on the host."""

    def __init__(
        self,
        num_rows: int,
        sampling: list[int],
        pending: PendingSample | None,
        prompt_logprobs: PromptLogprobRows | None = None,
    ) -> None:
        self.num_rows, self.sampling, self.pending = num_rows, sampling, pending
        self.prompt_logprobs = prompt_logprobs or {}

    def result(self) -> tuple[list[int | None], SamplerOutput | None]:
        tokens: list[int | None] = [None] * self.num_rows
        if self.pending is None:
            return tokens, None
        sampled = self.pending.result()
        for i, token_id in zip(self.sampling, sampled.token_ids, strict=True):
            tokens[i] = token_id
        return tokens, sampled
