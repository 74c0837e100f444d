"""The sampler's per-request state: what a request carries from step to step.

Owns, per live request: its seeded generator (made at its first sampled
step from SamplingParams.seed) and, for a request with penalties, its
device-side token history (worker/penalties.py); and, per step, the rows the
sampler takes for the requests that sample: their params, generators,
banned tokens and histories. Both kinds of state outlive preemption (a
preempted request recomputes its K/V, not its random stream or its counts)
and go when the request is freed.

Must never: draw from a generator or touch logits (the sampler does), or
decide which requests sample (the runner does, from the scheduler's plan).
"""

from __future__ import annotations

import torch

from tinyengine.sampling_params import SamplingParams
from tinyengine.scheduling.request import Request
from tinyengine.worker.penalties import TokenHistory
from tinyengine.worker.sampler import Sampler

# What Sampler.sample takes after the logits, one entry per sampling row:
# params, generators, banned token ids, and the histories (None: no penalties).
SamplerRows = tuple[
    list[SamplingParams],
    list[torch.Generator | None],
    list[list[int]],
    list[TokenHistory | None] | None,
]


class RequestSamplingState:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.generators: dict[str, torch.Generator] = {}
        self.histories: dict[str, TokenHistory] = {}  # requests with penalties

    def rows(self, requests: list[Request], vocab: int) -> SamplerRows:
        """The sampler's arguments for `requests` (the scheduler's Requests
        that sample this step, in row order)."""
        params = [r.sampling_params for r in requests]
        pairs = list(zip(requests, params, strict=True))
        return (
            params,
            [None if p.seed is None else self._generator(r.request_id, p.seed) for r, p in pairs],
            # Without min_tokens nothing is banned (_banned_tokens says so too).
            [_banned_tokens(r) if p.min_tokens else [] for r, p in pairs],
            self._histories(requests, vocab),
        )

    def free(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.histories.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = self.sampler.new_generator(seed)
        return generator

    def _histories(self, requests: list[Request], vocab: int) -> list[TokenHistory | None] | None:
        """Per row, a penalized request's device-side token history, made at
        its first sampled step. None when no row has penalties."""
        if not any(r.sampling_params.has_penalties for r in requests):
            return None
        out: list[TokenHistory | None] = []
        for r in requests:
            history = None
            if r.sampling_params.has_penalties:
                history = self.histories.get(r.request_id)
                if history is None:
                    history = self.histories[r.request_id] = self.sampler.new_history(
                        r.prompt_token_ids, vocab
                    )
            out.append(history)
        return out


def _banned_tokens(request: Request) -> list[int]:
    """Before min_tokens outputs exist, a request may not end: its eos and stop
    tokens are masked out of the distribution (vLLM's min_tokens semantics).
    Called for the row being launched, whose own token is already counted in
    num_inflight; earlier in-flight tokens count as outputs."""
    params = request.sampling_params
    if request.num_output_tokens + request.num_inflight - 1 >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(request.eos_token_ids)
    return banned
