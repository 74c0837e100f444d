"""The torch references of DeepSeek's two kernels -- MLA decode over the paged
latent cache (tinyengine/kernels/mla/reference.py) and the fused MoE
(tinyengine/kernels/moe/reference.py) -- against
slow, obvious implementations, on ragged shapes drawn by hypothesis; plus the
op sets that hand them (or their Triton twins) to the model."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hf_deepseek import make_tiny_deepseek
from tinyengine.kernels.mla.reference import mla_decode
from tinyengine.kernels.moe.reference import _fused_moe_dense, fused_moe
from tinyengine.kernels.workspace import Workspace

# ----------------------------------------------------------------------------- MLA decode


def mla_decode_naive(q_latent, q_rope, cache, block_tables, seq_lens, scale):
    """One sequence and one head at a time, token by token through the table."""
    num_seqs, num_heads, latent_dim = q_latent.shape
    block_size = cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for b in range(num_seqs):
        rows = torch.stack(
            [
                cache[int(block_tables[b, p // block_size]), p % block_size, 0].double()
                for p in range(seq_lens[b])
            ]
        )
        for h in range(num_heads):
            s = rows[:, :latent_dim] @ q_latent[b, h].double()
            s = s + rows[:, latent_dim:] @ q_rope[b, h].double()
            out[b, h] = torch.softmax(s * scale, dim=0) @ rows[:, :latent_dim]
    return out


def _mla_case(seq_lens, num_heads, latent_dim, rope_dim, block_size, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # a spare column
    num_blocks = num_seqs * max_blocks + 3
    cache = torch.randn(num_blocks, block_size, 1, latent_dim + rope_dim, generator=gen)
    # Scrambled, disjoint blocks per sequence; the unused tail of each table
    # points at arbitrary blocks, which the length mask must ignore.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: num_seqs * max_blocks].view(num_seqs, max_blocks).to(torch.int32)
    q_latent = torch.randn(num_seqs, num_heads, latent_dim, generator=gen)
    q_rope = torch.randn(num_seqs, num_heads, rope_dim, generator=gen)
    return q_latent.to(dtype), q_rope.to(dtype), cache.to(dtype), tables


@settings(max_examples=25, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    num_heads=st.sampled_from([1, 3, 8]),
    latent_dim=st.sampled_from([8, 32, 40]),
    rope_dim=st.sampled_from([2, 8]),
    block_size=st.sampled_from([1, 4, 16]),
    extra_len=st.integers(0, 20),
    seed=st.integers(0, 1000),
)
def test_mla_decode_matches_naive(
    seq_lens, num_heads, latent_dim, rope_dim, block_size, extra_len, seed
):
    q_latent, q_rope, cache, tables = _mla_case(
        seq_lens, num_heads, latent_dim, rope_dim, block_size, seed
    )
    scale = 0.3
    # max_seq_len beyond the true maximum (a graph sized for max_model_len)
    # must not change anything; the table has to be wide enough for it.
    max_seq_len = min(max(seq_lens) + extra_len, tables.shape[1] * block_size)
    out = mla_decode(
        q_latent, q_rope, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale,
        max_seq_len=max_seq_len,
    )  # fmt: skip
    ref = mla_decode_naive(q_latent, q_rope, cache, tables, seq_lens, scale)
    assert out.dtype == q_latent.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_mla_decode_workspace_and_bf16():
    seq_lens = [5, 33, 17]
    q_latent, q_rope, cache, tables = _mla_case(seq_lens, 4, 32, 8, 16, 0, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plain = mla_decode(q_latent, q_rope, cache, tables, lens, 0.2, max_seq_len=33)
    ws = Workspace("cpu")
    scratch = mla_decode(q_latent, q_rope, cache, tables, lens, 0.2, max_seq_len=33, workspace=ws)
    assert ws.size > 0 and plain.dtype == torch.bfloat16
    torch.testing.assert_close(plain, scratch, atol=0, rtol=0)
    ref = mla_decode_naive(q_latent, q_rope, cache, tables, seq_lens, 0.2)
    torch.testing.assert_close(plain.double(), ref, atol=2e-2, rtol=2e-2)


def test_mla_decode_rejects_narrow_table():
    q_latent, q_rope, cache, tables = _mla_case([4], 2, 8, 2, 4, 0)
    with pytest.raises(ValueError, match="columns"):
        mla_decode(
            q_latent, q_rope, cache, tables, torch.tensor([4], dtype=torch.int32), 1.0,
            max_seq_len=tables.shape[1] * 4 + 1,
        )  # fmt: skip


# ----------------------------------------------------------------------------- fused MoE


def fused_moe_naive(x, w13, w2, topk_weights, topk_ids):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            xt = x[t].double()
            gate, up = w13[e, :inter].double() @ xt, w13[e, inter:].double() @ xt
            h = torch.nn.functional.silu(gate) * up
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ h)
    return out


def _moe_case(num_tokens, num_experts, top_k, hidden, inter, seed, distinct=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    if distinct:
        ids = torch.stack(
            [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
        ) if num_tokens else torch.zeros(0, top_k, dtype=torch.long)  # fmt: skip
    else:  # repeated ids within a token must add up, too
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids.to(torch.int64)


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    num_experts=st.integers(1, 9),
    top_k=st.integers(1, 4),
    hidden=st.sampled_from([4, 16]),
    inter=st.sampled_from([3, 8]),
    distinct=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fused_moe_matches_naive(num_tokens, num_experts, top_k, hidden, inter, distinct, seed):
    top_k = min(top_k, num_experts)
    case = _moe_case(num_tokens, num_experts, top_k, hidden, inter, seed, distinct)
    out = fused_moe(*case)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), fused_moe_naive(*case), atol=1e-5, rtol=1e-5)
    # The graph-safe dense path computes the same thing.
    torch.testing.assert_close(_fused_moe_dense(*case), out, atol=1e-5, rtol=1e-5)


def test_fused_moe_bf16_and_bad_ids():
    x, w13, w2, weights, ids = _moe_case(6, 5, 2, 16, 8, 0)
    out = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_naive(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), ref, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="experts"):
        fused_moe(x, w13, w2, weights, ids + 5)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :3], weights, ids)


# ----------------------------------------------------------------------------- dispatch


def test_op_sets_hold_their_own_implementations():
    """Every field of the torch set is a torch reference; the Triton set on
    CUDA holds Triton launchers for every op; on CPU it keeps the references
    for the ops whose kernels only pay off on a GPU."""
    from tinyengine.kernels import OpSet, torch_ops, triton_ops

    # Not ops: the set's name and the batch-invariant set's row blocking.
    fields = [f.name for f in dataclasses.fields(OpSet) if f.name not in ("name", "row_blocks")]
    torch_set, cuda_set, cpu_set = torch_ops(), triton_ops("cuda"), triton_ops("cpu")
    assert not torch_set.batch_invariant and torch_set.row_blocks is None
    # DeepSeek-V4's plain cache write and MLA's per-head projections (an
    # einsum: cuBLAS's batched GEMM) are the references in both sets.
    reference_only = ("write_rows", "head_matmul")
    assert torch_set.sample_draw is None
    for name in fields:
        op = getattr(torch_set, name)
        assert op is None or op.__module__.endswith(".reference"), (name, op.__module__)
        triton_op = getattr(cuda_set, name)
        if name in reference_only:
            assert triton_op is op and getattr(cpu_set, name) is op, name
            continue
        assert triton_op.__module__.split(".")[-1] in ("triton", "silu", "norm_linear"), (
            name,
            triton_op,
        )
    for name in ("write_kv_cache", "paged_attention", "rope_write_kv", "mla_decode", "fused_moe"):
        assert getattr(cpu_set, name) is getattr(cuda_set, name)
    for name in (
        "rms_norm",
        "silu_and_mul",
        "linear",
        "linear_silu_mul",
        "rms_norm_linear",
        "sample_draw",
    ):
        assert getattr(cpu_set, name) is getattr(torch_set, name)


_TORCH_ONLY_FORWARD = """
import sys
from tests.models.forward_harness import PagedHarness, load_tiny
from tinyengine.kernels import torch_ops

harness = PagedHarness(load_tiny(sys.argv[1]), block_size=4, num_blocks=64, ops=torch_ops())
harness.step({0: list(range(3, 12)), 1: list(range(5, 9))})  # prefill (expanded MLA)
harness.step({0: [7], 1: [8]})  # decode (absorbed MLA, MoE, norms, linear)
assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("triton"))
"""


def test_torch_op_set_runs_without_triton(tmp_path):
    """A full DeepSeek forward (prefill then decode) with the torch op set never
    imports triton: no model layer reaches a Triton module behind the set's back.
    A fresh interpreter, because this test process has long imported triton."""
    path = make_tiny_deepseek("v3", tmp_path / "v3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _TORCH_ONLY_FORWARD, str(path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
