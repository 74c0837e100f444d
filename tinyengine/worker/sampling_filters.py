"""Top-k, top-p and min-p as one per-row logit threshold (the sampler's filters).

Owns the per-row parameter table's columns (the table the sampler sends
host->device in one copy), what a batch's filters need (`filter_needs`), and
the threshold itself (`cutoff`): a token survives iff its logit >= its row's
cutoff. Both sampler paths (worker/sampler.py) filter through it, so a row's
kept set is the same whichever path its batch took.

Must never: synchronize with the device (no `.item()`, no data-dependent
Python branches on tensors), modify the logits it is given, or let one row's
filters change another row's threshold (a row with a filter off gets a
cutoff that masks nothing exactly, not "almost nothing").
"""

from __future__ import annotations

import torch

from tinyengine.sampling_params import SamplingParams

# Columns of the per-row parameter table that travels host->device in one copy
# (INV_TEMP only on the fused path: 0 marks a greedy row for the kernel).
TEMP, TOP_K, TOP_P, LOG_MIN_P, INV_TEMP = range(5)


def filter_needs(live: list[SamplingParams], vocab: int) -> tuple[int, bool, bool, bool]:
    """What the sampled rows' filters need: (max_k, need_top_p, full_sort,
    need_min_p), as `cutoff` takes them; all falsy: no row filters."""
    need_top_p = any(p.top_p < 1.0 for p in live)
    need_min_p = any(p.min_p > 0.0 for p in live)
    max_k = max((p.top_k for p in live if 0 < p.top_k < vocab), default=0)
    full_sort = any(p.top_p < 1.0 and not 0 < p.top_k < vocab for p in live)
    return max_k, need_top_p, full_sort, need_min_p


def cutoff(
    logits: torch.Tensor,
    t: torch.Tensor,
    max_k: int,
    need_top_p: bool,
    full_sort: bool,
    need_min_p: bool,
) -> torch.Tensor:
    """Per-row logit threshold [rows, 1]: a token survives iff logit >= cutoff.

    `t` is the parameter table (TOP_K, TOP_P and LOG_MIN_P columns read).
    `max_k` is the largest top-k any sampled row asks for (0: none does);
    `full_sort` says some sampled row wants top-p without a top-k. Rows whose
    filter is disabled get a cutoff that masks nothing exactly (not "almost
    nothing"), so a row's tokens do not depend on whether another row in the
    batch switched a filter on.
    """
    num_rows, vocab = logits.shape
    threshold = torch.full((num_rows, 1), float("-inf"), device=logits.device)
    top_k = t[:, TOP_K].long()[:, None]  # exact: vocab sizes fit a float32 mantissa

    if max_k or need_top_p:
        # Top-p needs the distribution in descending order, but only as far
        # as top-k reaches: when every top-p row also has a top-k, a partial
        # selection of max_k values replaces the full-vocabulary sort.
        if full_sort:
            ranked = logits.sort(dim=-1, descending=True).values
        else:
            ranked = logits.topk(max_k, dim=-1).values  # sorted, descending
        width = ranked.shape[-1]
        if max_k:
            positions = torch.arange(width, device=logits.device)
            ranked = ranked.masked_fill(positions >= top_k, float("-inf"))
        num_kept = top_k
        if need_top_p:
            probs = ranked.softmax(dim=-1)  # renormalized over each row's top-k
            mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
            top_p = t[:, TOP_P : TOP_P + 1]
            # Keep a token while the mass strictly before it is < top_p: the
            # smallest prefix reaching top_p. top_p == 1 rows are exempt, since
            # fp rounding can push the cumsum of the tail past 1.0.
            drop = (mass_before >= top_p) & (top_p < 1.0)
            # At least the top token: a top_p below float32's smallest value
            # (1e-46 is a valid request) is 0 in the table, which drops all.
            num_kept = (~drop).sum(dim=-1, keepdim=True).clamp(min=1).clamp(max=top_k)
        threshold = ranked.gather(1, num_kept.clamp(max=width) - 1)
        if not full_sort:
            # Rows without a top-k were cut at width max_k; here they have
            # top_p == 1 too (else full_sort), so they keep everything.
            threshold = threshold.masked_fill(top_k >= vocab, float("-inf"))

    if need_min_p:
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p); no softmax
        # needed, and top-k/top-p never remove the max, so order does not matter.
        max_logit = logits.amax(dim=-1, keepdim=True)
        threshold = torch.maximum(threshold, max_logit + t[:, LOG_MIN_P : LOG_MIN_P + 1])
    return threshold
