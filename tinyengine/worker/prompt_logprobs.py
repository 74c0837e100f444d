"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt
token after the first, its log-probability under the model given the tokens
before it, its rank, and the top N of that distribution.

Owns turning a step's hidden states into those rows for the requests that ask.
Prompt position p's hidden state predicts token p + 1, so a chunk that computes
positions [start, end) yields the entries of prompt tokens start + 1 ..
min(end, P - 1) (P = prompt length; the last prompt position predicts the first
output token, which the sampler handles). The rows use the sampler's format:
[(token, logprob, rank), then the top N as (id, logprob, rank)], so the engine
turns them into Logprob dicts the same way.

Cost and sync: the logits of the prompt rows are computed in slices of
`_ROWS_PER_SLICE` (a whole 8k-token chunk at a 152k vocabulary would be 5 GB of
fp32), and the results are copied to the host at once — a synchronizing copy,
so a step that carries prompt logprobs does not overlap with the next one.
Only such requests pay; the scheduler also gives them no prefix-cache hit (a
cached block has no logits).
"""

from __future__ import annotations

from typing import Any

import torch

from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.sample_output import PromptLogprobRows, ranked_logprobs

_ROWS_PER_SLICE = 256


def prompt_logprobs(
    model: Any, ops: Any, hidden: torch.Tensor, plan: SchedulerOutput
) -> PromptLogprobRows:
    """The rows of this step's prompt positions, for each scheduled request
    with prompt_logprobs; `hidden` holds the step's rows in plan order."""
    out: PromptLogprobRows = {}
    offset = 0  # the first hidden row of each scheduled request
    for sched in plan.scheduled:
        request, n = sched.request, sched.num_new_tokens
        num_top = request.sampling_params.prompt_logprobs
        stop = min(sched.start + n, len(request.prompt_token_ids) - 1)
        if num_top is not None and stop > sched.start:
            rows = hidden[offset : offset + stop - sched.start]
            targets = request.prompt_token_ids[sched.start + 1 : stop + 1]
            out[request.request_id] = (sched.start + 1, _rows(model, ops, rows, targets, num_top))
        offset += n
    return out


def _rows(model: Any, ops: Any, hidden: torch.Tensor, targets: list[int], num_top: int) -> list:
    result = []
    for lo in range(0, len(targets), _ROWS_PER_SLICE):
        h = hidden[lo : lo + _ROWS_PER_SLICE]
        logits = model.compute_logits(h, ops)
        target = torch.tensor(targets[lo : lo + len(h)], device=logits.device)
        chosen_lp, rank, *top = ranked_logprobs(logits, target, min(num_top, logits.shape[-1]))
        host = [x.tolist() for x in (target, chosen_lp[:, 0], rank[:, 0], *top)]
        for i in range(len(h)):
            row = [(host[0][i], host[1][i], host[2][i])]
            row += zip(*(t[i] for t in host[3:]), strict=True)  # top (id, logprob, rank)
            result.append(row)
    return result
