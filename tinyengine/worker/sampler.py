"""Sampler: one batch of logits -> one next token per row (+ optional logprobs).

Owns the per-step token choice: penalties (worker/penalties.py), banned-token
masking, greedy argmax, temperature, top-k / top-p / min-p filtering (its
threshold in worker/sampling_filters.py), seeded and unseeded random
sampling (the noise: worker/sampling_noise.py), and the logprobs a request
asked for. Everything is vectorized over the batch; the host learns the
results through exactly one device->host copy.
`sample` only launches the work and starts that copy (into pinned memory,
behind an event), so the engine can schedule and launch the next step before
`PendingSample.result()` waits for it; the sampled ids also stay on the device
(`PendingSample.token_ids`) for the next step's inputs.

Two implementations of the draw, chosen per sampler by its `draw` op (the
engine passes its op set's `sample_draw`: the Triton kernel on CUDA, None for
the torch op set and on CPU):
  * torch (draw=None): logits.float(), ban, argmax for greedy rows; sampled rows are
    divided by their temperature, filtered, softmaxed and drawn by an
    exponential race whose Exp(1) noise (vocab draws per row and step) comes
    from torch generators. About 8 full passes over a [rows, vocab] fp32 tensor,
    which is fine on CPU, and what the CPU tests pin down token for token.
  * fused (a draw op): one kernel (kernels/sampling/) draws every row at
    once by the Gumbel-max trick, temperature folded in, greedy rows as plain
    argmax: one pass over the logits in their own dtype. Each row's noise is a
    pure function of one int64 seed per row and step, drawn on the device from
    the row's generator. Fast path, when no sampled row filters (top-k/top-p/
    min-p): no fp32 copy of the logits at all (banned tokens are set to -inf on
    a copy in the logits' dtype; logprobs convert only the rows that ask).
    Filter path, when some sampled row filters: cutoffs are computed in fp32 as
    on the torch path, filtered tokens become -inf, and the same kernel draws with the same
    seeds. A row that does not filter sees exactly the same kernel inputs on
    both paths, so its token does not depend on which path its batch took.

A decode CUDA graph captures the draw op too (ModelRunner.decode_step);
`stage_graph_draw` gives it a fast-path batch's inputs, with the seeds the
eager path would draw, so a row's token is the same either way.

Must never:
  * modify the caller's logits (the runner may read them again, and logprobs
    are defined on them as given);
  * synchronize with the device before the final copy (no `.item()`, no
    data-dependent Python branches on tensors, no pageable host->device copies);
  * draw a seeded request's noise from anything but that request's generator,
    or draw an amount that depends on the batch. A seeded request must produce
    the same tokens whatever else shares its batch and whatever its row index
    (torch: exactly `vocab` Exp(1) draws per sampled step; fused: exactly one
    int64 seed per sampled step, the kernel's noise being a function of it).
    Greedy steps draw nothing.

Logprobs are the model's distribution: log_softmax of the raw logits as given,
before banning, temperature and filters (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.input_buffers import write
from tinyengine.worker.penalties import TokenHistory, penalize, record
from tinyengine.worker.sample_output import (
    PendingSample,
    SamplerOutput,
    ranked_logprobs,
    to_host,
)
from tinyengine.worker.sampling_filters import INV_TEMP, TEMP, cutoff, filter_needs
from tinyengine.worker.sampling_noise import draw_seeds, exponential_noise

# Temperatures below this are treated as greedy (as vLLM does): dividing by a
# denormal-ish temperature overflows the logits to inf and softmax to NaN.
_GREEDY_EPS = 1e-5


class Sampler:
    """Chooses next tokens for a batch of rows, each with its own SamplingParams."""

    def __init__(
        self,
        device: torch.device | str,
        seed: int | None = 0,
        draw: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.device = torch.device(device)
        # Shared noise source for rows whose request has no seed (seed None:
        # a nondeterministic one).
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # The fused path's one-pass draw, with gumbel_argmax's signature
        # (kernels/sampling/); None: the torch path (module docstring).
        self.draw = draw

    def new_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the sampler's device (noise is drawn on
        the logits' device, so a CPU generator would not do on CUDA)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]] | None = None,
        histories: list[TokenHistory | None] | None = None,
    ) -> SamplerOutput:
        """Sample and wait for the result (sample(...).result())."""
        return self.sample(logits, params, generators, banned_token_ids, histories).result()

    def seeds(
        self,
        generators: list[torch.Generator | None],
        greedy: list[bool],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused draw's per-row seeds (worker/sampling_noise.py: draw_seeds)."""
        return draw_seeds(self.device, self.generator, generators, greedy, out)

    def new_history(self, prompt_token_ids: list[int], vocab: int) -> TokenHistory:
        """The device-side token history a request with penalties needs."""
        return TokenHistory(prompt_token_ids, vocab, self._to_device)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]] | None = None,
        histories: list[TokenHistory | None] | None = None,
    ) -> PendingSample:
        """`histories`: per row, its TokenHistory (needed by rows with
        penalties, which count their sampled token into it here)."""
        num_rows, vocab = logits.shape
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"Sampler got {num_rows} logit rows but {len(params)} params and "
                f"{len(generators)} generators; pass exactly one of each per row"
            )
        if banned_token_ids is not None and len(banned_token_ids) != num_rows:
            raise ValueError(
                f"Sampler got {num_rows} logit rows but {len(banned_token_ids)} "
                "banned_token_ids lists; pass one (possibly empty) list per row"
            )
        # Penalized rows draw from adjusted logits (a copy); logprobs stay raw.
        raw = logits
        if any(p.adjusts_logits for p in params):
            logits = penalize(logits, params, histories or [None] * num_rows, self._to_device)
        if self.draw is not None:
            pending = self._sample_fused(raw, logits, params, generators, banned_token_ids)
        else:
            pending = self._sample_torch(raw, logits, params, generators, banned_token_ids)
        if raw is not logits:
            record(pending.token_ids, params, histories or [None] * num_rows)
        return pending

    # ------------------------------------------------------------------ steps

    def _sample_torch(
        self,
        raw: torch.Tensor,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]] | None,
    ) -> PendingSample:
        """The torch path (module docstring). `logits`: penalized, `raw`: not."""
        masked = self._ban(logits.float(), banned_token_ids)  # no-op .float() for fp32

        # Greedy rows are decided on the host from params (no sync); argmax is
        # cheap, so take it for every row and let sampled rows overwrite it.
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        tokens = masked.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(masked, params, generators, greedy)
            if any(greedy):
                is_greedy = self._to_device(greedy, torch.bool)
                tokens = torch.where(is_greedy, tokens, sampled)
            else:
                tokens = sampled

        return self._collect(raw, tokens, params)

    def _ban(self, logits: torch.Tensor, banned: list[list[int]] | None) -> torch.Tensor:
        """-inf at banned (row, token) pairs, on a copy: the caller's logits stay raw."""
        if not banned or not any(banned):
            return logits
        rows = [r for r, ids in enumerate(banned) for _ in ids]
        cols = [t for ids in banned for t in ids]
        index = self._to_device([rows, cols], torch.long)
        # A device-side fill for the value: a Python scalar would be copied
        # host->device on every call.
        minus_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
        return logits.index_put((index[0], index[1]), minus_inf)

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        """Temperature, filters, then one random draw per row. Greedy rows run
        through too (temperature 1, no noise of their own); the caller discards them."""
        vocab = logits.shape[-1]
        table = [
            [
                1.0 if g else p.temperature,
                p.top_k if 0 < p.top_k < vocab else vocab,  # vocab = keep all
                p.top_p,
                math.log(p.min_p) if p.min_p > 0 else -math.inf,
            ]
            for p, g in zip(params, greedy, strict=True)
        ]
        t = self._to_device(table, torch.float32)
        logits = logits / t[:, TEMP : TEMP + 1]

        live = [p for p, g in zip(params, greedy, strict=True) if not g]
        max_k, need_top_p, full_sort, need_min_p = filter_needs(live, vocab)
        if max_k or need_top_p or need_min_p:
            threshold = cutoff(logits, t, max_k, need_top_p, full_sort, need_min_p)
            # Ties with the cutoff are all kept: equal logits mean equal
            # probability, so no arbitrary sort order decides between them.
            logits = logits.masked_fill(logits < threshold, float("-inf"))

        probs = logits.softmax(dim=-1)
        noise = exponential_noise(probs, self.generator, generators, greedy)
        # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p
        # (the Gumbel-max trick in another guise), with no cumsum or search.
        return probs.div_(noise).argmax(dim=-1)

    def stage_graph_draw(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]],
        vocab: int,
        inv_temperature: torch.Tensor,
        seeds: torch.Tensor,
    ) -> bool:
        """Stage the draw a decode graph captured, `draw(logits,
        inv_temperature, seeds)` over its rows (this batch's first), when the
        batch takes the fast path with no banned token: write the rows'
        inverse temperatures (0 for padding: argmax) and seeds, drawn as the
        eager fast path draws them, and return True; `finish` then collects
        the graph's tokens. False: nothing written, `sample` runs instead."""
        if self.draw is None or any(p.adjusts_logits for p in params) or any(banned):
            return False
        greedy, filters = self._plan(params, vocab)
        if filters:
            return False
        inv_temp = _inverse_temperatures(params, greedy)
        write(inv_temperature, inv_temp, pad_to=inv_temperature.shape[0])
        if not all(greedy):  # greedy rows' seeds are never read
            self.seeds(generators, greedy, out=seeds[: len(params)])
        return True

    def finish(
        self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> PendingSample:
        """After a staged graph draw: logprobs and the copy to the host."""
        return self._collect(logits, tokens, params)

    def _plan(self, params: list[SamplingParams], vocab: int) -> tuple[list[bool], tuple]:
        """Which rows are greedy, and the sampled rows' filter needs
        (filter_needs: max_k, top_p, full_sort, min_p), or () when no sampled
        row filters: the draw's fast path."""
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        live = [p for p, g in zip(params, greedy, strict=True) if not g]
        needs = filter_needs(live, vocab)
        max_k, need_top_p, _, need_min_p = needs
        return greedy, needs if (max_k or need_top_p or need_min_p) else ()

    def _sample_fused(
        self,
        raw: torch.Tensor,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[list[int]] | None,
    ) -> PendingSample:
        """Every row through the draw op (module docstring: fast path and
        filter path). `logits`: penalized, `raw`: not (for logprobs)."""
        draw = self.draw
        vocab = logits.shape[-1]
        greedy, filters = self._plan(params, vocab)
        seeds = self.seeds(generators, greedy)
        if not filters:
            # Fast path: the logits in their own dtype; a ban copies them once.
            inv_t = self._to_device(_inverse_temperatures(params, greedy), torch.float32)
            tokens = draw(self._ban(logits, banned), inv_t, seeds)
            return self._collect(raw, tokens, params)
        max_k, need_top_p, full_sort, need_min_p = filters

        # Filter path: the torch path's cutoffs (on the fp32 logits divided by
        # the temperature), then the same draw on the raw logits with -inf at
        # every filtered token. Greedy rows get no filter at all (argmax is
        # what they want, and a cutoff never removes the max anyway).
        table = [
            [1.0, vocab, 1.0, -math.inf, 0.0]
            if g
            else [
                p.temperature,
                p.top_k if 0 < p.top_k < vocab else vocab,  # vocab = keep all
                p.top_p,
                math.log(p.min_p) if p.min_p > 0 else -math.inf,
                1.0 / p.temperature,  # the fast path's value, bit for bit
            ]
            for p, g in zip(params, greedy, strict=True)
        ]
        t = self._to_device(table, torch.float32)
        scaled = self._ban(logits.float(), banned) / t[:, TEMP : TEMP + 1]
        threshold = cutoff(scaled, t, max_k, need_top_p, full_sort, need_min_p)
        # The kernel reads the logits in their own dtype on both paths (one
        # compiled variant: warmup compiles it, and a bf16 fast-path step after
        # READY compiles nothing). A row without filters gets a cutoff that
        # masks nothing exactly, so it sees exactly the fast path's input.
        masked = self._ban(logits, banned).masked_fill(scaled < threshold, float("-inf"))
        tokens = draw(masked, t[:, INV_TEMP], seeds)
        return self._collect(raw, tokens, params)

    def _collect(
        self, raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> PendingSample:
        """Logprobs for the rows that asked, then everything to the host in one
        copy, started here and waited for in PendingSample.result(). `raw` may
        be in any float dtype: only the rows that ask are converted to fp32."""
        num_rows = len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return PendingSample(tokens, to_host(tokens), num_rows, rows, [], 0)

        if len(rows) == num_rows:
            lp_logits, lp_tokens = raw, tokens
        else:
            index = self._to_device(rows, torch.long)
            lp_logits, lp_tokens = raw.index_select(0, index), tokens.index_select(0, index)
        vocab = raw.shape[-1]
        wanted = [min(params[i].logprobs or 0, vocab) for i in rows]  # tiny test vocabs
        n = max(wanted)
        parts = [tokens, lp_tokens, *ranked_logprobs(lp_logits, lp_tokens, n)]

        # One device->host copy for everything: float64 holds token ids and ranks
        # exactly and fp32 logprobs losslessly.
        packed = torch.cat([x.flatten().double() for x in parts])
        return PendingSample(tokens, to_host(packed), num_rows, rows, wanted, n)

    # ---------------------------------------------------------------- helpers

    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor without a sync: a pageable H2D copy blocks
        the host, a pinned one with non_blocking=True does not (the caching host
        allocator keeps the pinned block alive until the copy is done)."""
        pin = self.device.type == "cuda"
        return torch.tensor(data, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=pin)


def _inverse_temperatures(params: list[SamplingParams], greedy: list[bool]) -> list[float]:
    """The fast path's per-row draw input: 1 / temperature, 0 for greedy rows."""
    return [0.0 if g else 1.0 / p.temperature for p, g in zip(params, greedy, strict=True)]
