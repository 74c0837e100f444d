"""The warp-specialized Gluon prefill attention (kernels/attention/gluon.py)
on a Hopper GPU: against SDPA and against the Triton kernel on long
prefills (varlen, chunks after a cached prefix, GQA, 16- and 64-token
pages), and with NaN in cache rows past each sequence's end. Skipped without
a Hopper GPU and Gluon."""

from __future__ import annotations

import math

import pytest
import torch

import tinyengine.kernels.attention.gluon as prefill_gluon
from tests.kernels.test_triton_attention_gpu import _fast_batch, _rel_err, _sdpa_reference


def _gluon_runs(b) -> bool:
    indices = (b.block_tables, b.query_start_loc, b.seq_lens_t)
    return prefill_gluon.supports(b.q, b.k_cache, b.v_cache, indices, max(b.q_lens))


CASES = {
    "one_prompt_2k": ([2048], [2048]),
    # Chunks after cached prefixes, a prompt shorter than a tile, rows past
    # a sequence inside the last tile, and lengths off every page boundary.
    "varlen_prefix": ([512, 300, 129, 700, 1], [1536, 300, 1129, 700, 40]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_gluon_prefill_matches_sdpa_and_triton(monkeypatch, case: str,
                                                   block_size: int) -> None:  # fmt: skip
    q_lens, seq_lens = CASES[case]
    b = _fast_batch(q_lens, seq_lens, block_size)
    if not _gluon_runs(b):
        pytest.skip("no Gluon or not a Hopper GPU")
    out = b.run()
    assert prefill_gluon._compile_failed == []
    assert _rel_err(out, _sdpa_reference(b)) < 1e-2
    monkeypatch.setattr(prefill_gluon, "supports", lambda *a, **k: False)
    assert _rel_err(out, b.run()) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_prefill_ignores_nan_past_the_sequence() -> None:
    """Slots after each sequence's last token, in its last page, hold NaN
    (never-written cache rows may): the output stays finite and equal to
    SDPA's on the live rows."""
    q_lens, seq_lens = [200, 333], [200, 1000]
    b = _fast_batch(q_lens, seq_lens, 64)
    if not _gluon_runs(b):
        pytest.skip("no Gluon or not a Hopper GPU")
    for i, s in enumerate(seq_lens):
        last = b.block_tables[i, math.ceil(s / 64) - 1].item()
        b.k_cache[last, s % 64 :] = float("nan")
        b.v_cache[last, s % 64 :] = float("nan")
    out = b.run()
    assert not out.isnan().any()
    assert _rel_err(out, _sdpa_reference(b)) < 1e-2


@pytest.mark.gpu
def test_gpu_short_prefills_stay_on_triton() -> None:
    b = _fast_batch([127, 5], [127, 500])
    indices = (b.block_tables, b.query_start_loc, b.seq_lens_t)
    assert not prefill_gluon.supports(b.q, b.k_cache, b.v_cache, indices, 127)
    assert _rel_err(b.run(), _sdpa_reference(b)) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_prefill_on_the_engine_layouts() -> None:
    """The engine's cache keeps a head's K and V side by side in one
    allocation (tinyengine/worker/kv_cache.py) and its query is a slice of the
    fused QKV projection: the kernel runs on those strided views, not on
    copies, and matches SDPA."""
    b = _fast_batch([512, 300, 129], [1536, 300, 1129], 16)
    storage = torch.cat([b.k_cache, b.v_cache], dim=-1)
    b.k_cache, b.v_cache = storage[..., :128], storage[..., 128:]
    hq, d = b.q.shape[1], b.q.shape[2]
    qkv = torch.zeros(b.num_tokens, hq * d + 2 * 8 * d, device="cuda", dtype=b.q.dtype)
    qkv[:, : hq * d] = b.q.flatten(1)
    b.q = qkv[:, : hq * d].view(b.num_tokens, hq, d)
    if not _gluon_runs(b):
        pytest.skip("no Gluon or not a Hopper GPU")
    assert _rel_err(b.run(), _sdpa_reference(b)) < 1e-2
    assert prefill_gluon._compile_failed == []
