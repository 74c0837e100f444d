"""Repetition, frequency and presence penalties and logit biases: a request's
token history on the device, and the logit adjustment the sampler applies
before it draws.

The three penalties, as vLLM defines them (and OpenAI, for the last two), on
the raw logits of a row, before temperature and filters:
  * repetition_penalty r (1 = off; HF's RepetitionPenaltyLogitsProcessor): every
    token already in the prompt or the output has its logit divided by r when
    positive, multiplied by r when not, so r > 1 makes repeats less likely;
  * frequency_penalty f: logit -= f * (times the token is in the output);
  * presence_penalty p: logit -= p * (1 if the token is in the output);
  * logit_bias {token: b} (OpenAI's): logit += b, *before* the penalties,
    the order of vLLM (its logit-bias processor runs ahead of the penalties)
    and of HF (SequenceBiasLogitsProcessor ahead of the repetition penalty):
    a biased token already seen has its biased logit divided by r.

Why the history lives on the device. With asynchronous scheduling the engine
launches step N+1 before step N's token reaches the host, so a history built
from the host's output ids would miss the in-flight token. Instead each
penalized request keeps its output-token counts in a device vector that the
sampler bumps with the sampled id right after each draw (device-side: no
sync), so step N+1's penalties always see step N's token. Preemption keeps the
history (it lives until the request finishes, like its seeded generator).

Cost: nothing for rows without penalties; a batch with some copies the logits
once and does a few [penalized rows, vocab] passes. Logprobs stay those of the
raw logits (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tinyengine.sampling_params import SamplingParams

ToDevice = Callable[[list, torch.dtype], torch.Tensor]


class TokenHistory:
    """One request's tokens as the penalties see them: `counts[v]`, how often
    token v is in the output so far, and `in_prompt[v]`."""

    def __init__(self, prompt_token_ids: list[int], vocab: int, to_device: ToDevice) -> None:
        ids = to_device([t for t in prompt_token_ids if 0 <= t < vocab], torch.long)
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=ids.device)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
        self.in_prompt[ids] = True
        self._one = torch.ones(1, dtype=torch.int32, device=ids.device)

    def record(self, token: torch.Tensor) -> None:
        """Count the sampled token ([1] long tensor, on the device)."""
        self.counts.index_add_(0, token, self._one)


def penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None],
    to_device: ToDevice,
) -> torch.Tensor:
    """The logits with every penalized or biased row adjusted, on a copy in
    the logits' dtype (the arithmetic is fp32); the logits themselves when no
    row adjusts them. Rows with penalties must have a history."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    index = to_device(rows, torch.long)
    table = to_device(
        [
            [params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
            for i in rows
        ],
        torch.float32,
    )
    rep, freq, pres = table[:, 0:1], table[:, 1:2], table[:, 2:3]
    x = logits.index_select(0, index).float()
    bias = [(j, t, v) for j, i in enumerate(rows) for t, v in (params[i].logit_bias or {}).items()]
    if bias:
        where = to_device([[j for j, _, _ in bias], [t for _, t, _ in bias]], torch.long)
        values = to_device([v for _, _, v in bias], torch.float32)
        x = x.index_put((where[0], where[1]), values, accumulate=True)
    if any(params[i].has_penalties for i in rows):
        # A row with only a logit bias has no history: zeros change nothing
        # there (rep = 1, freq = pres = 0).
        zeros = torch.zeros(logits.shape[-1], dtype=torch.int32, device=x.device)
        counts = torch.stack([_history(histories, i).counts if params[i].has_penalties
                              else zeros for i in rows])  # fmt: skip
        in_prompt = torch.stack([_history(histories, i).in_prompt if params[i].has_penalties
                                 else zeros.bool() for i in rows])  # fmt: skip
        in_output = counts > 0
        x = torch.where(in_prompt | in_output, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * in_output
    return logits.index_put((index,), x.to(logits.dtype))


def record(
    tokens: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> None:
    """After a draw: each penalized row's history counts its sampled token."""
    for i, p in enumerate(params):
        if p.has_penalties:
            _history(histories, i).record(tokens[i : i + 1])


def _history(histories: list[TokenHistory | None], row: int) -> TokenHistory:
    h = histories[row]
    if h is None:
        raise ValueError(f"row {row} has penalties but no TokenHistory")
    return h
