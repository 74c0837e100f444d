"""The CPU batch-invariant op set's per-token path (OpSet.per_token, what
routers and V4's hyper-connection mixes run through): a row's result has the
same bits wherever the row sits in the batch, also for matmuls with very few
outputs, which MKL rounds by a row's index inside a multi-row call on some
machines (kernels/batch_invariant.py's by_single_rows)."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels import torch_ops
from tinyengine.kernels.batch_invariant import batch_invariant_ops


@pytest.mark.parametrize("outputs", [1, 2, 3, 8, 24])
def test_a_row_is_the_same_wherever_it_sits(outputs):
    ops = batch_invariant_ops(torch_ops())
    gen = torch.Generator().manual_seed(outputs)
    x = torch.randn(40, 2, 64, generator=gen)
    w = torch.randn(outputs, 128, generator=gen)

    def mixes(s: torch.Tensor) -> torch.Tensor:
        return s.flatten(1) @ w.t()  # as models/hyper_connections.py computes them

    alone = [ops.per_token(mixes, x[i : i + 1])[0] for i in range(40)]
    for start, stop in [(0, 40), (3, 40), (5, 13), (17, 18), (9, 37)]:
        got = ops.per_token(mixes, x[start:stop])
        for i in range(start, stop):
            assert torch.equal(got[i - start], alone[i]), (start, stop, i)
