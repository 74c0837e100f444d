"""The merge of split-KV partials (kernels/split_reduce.py) against the
formula it implements (the Triton interpreter on CPU, the GPU where there
is one): live and dead splits, split counts that do not fill a chunk,
sinks, an all-dead row."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels import split_reduce

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(part_out, part_lse, sinks):
    """out = sum_s 2^(lse_s - M) part_s / (sum_s 2^(lse_s - M) + 2^(sink - M))."""
    lse = part_lse.double()
    m = lse.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1) * 1.4426950408889634
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse - m)
    total = w.sum(-1)
    if sinks is not None:
        total = total + torch.exp2(sink - m).squeeze(-1)
    num = (w.unsqueeze(-1) * torch.nan_to_num(part_out.double())).sum(-2)
    return num / torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)


@pytest.mark.parametrize("num_splits", [1, 3, 6, 9])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("chunk", [4, 16])
def test_merge_matches_the_formula(num_splits, with_sinks, chunk, monkeypatch) -> None:
    monkeypatch.setattr(split_reduce, "_CHUNK_S", chunk)
    g = torch.Generator().manual_seed(num_splits)
    rows, heads, dim = 3, 2, 40
    part_out = torch.randn(rows, heads, num_splits, dim, generator=g)
    part_lse = torch.randn(rows, heads, num_splits, generator=g) * 4
    part_lse[0, 1, -1] = float("-inf")  # a dead split: its partial is never read
    part_out[0, 1, -1] = float("nan")
    part_lse[2, 0, :] = float("-inf")  # a row with no key at all
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device=DEVICE)
    moved = [t.to(DEVICE) if t is not None else None for t in (part_out, part_lse, sinks)]
    split_reduce.merge_splits(out, *moved[:2], num_splits, 16, moved[2])
    out = out.cpu()
    ref = _reference(part_out, part_lse, sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    if not with_sinks:
        assert (out[2, 0] == 0).all()
