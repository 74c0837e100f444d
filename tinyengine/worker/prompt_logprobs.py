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

from tinyengine.worker.sample_output import PromptLogprobRows, ranked_logprobs
from tinyengine.worker.step_inputs import PromptRows

_ROWS_PER_SLICE = 256


def prompt_logprobs(
    model: Any, ops: Any, hidden: torch.Tensor, work: list[PromptRows]
) -> PromptLogprobRows:
    """The rows of this step's prompt positions, for each request in `work`
    (worker/step_inputs.py's prompt_rows); `hidden` holds the step's rows."""
    out: PromptLogprobRows = {}
    for w in work:
        rows = hidden[w.offset : w.offset + len(w.targets)]
        out[w.request_id] = (w.first, _rows(model, ops, rows, w.targets, w.num_top))
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
