"""Shared by the Triton paged-attention tests (test_triton_attention*.py): a
random varlen batch over a randomly permuted, NaN-poisoned paged cache, its
naive float64 dense reference, and the comparison helpers.

Unused cache slots and block-table padding point at NaN, so any read outside
a sequence's context shows up as NaN in the output.
"""

from __future__ import annotations

import math

import torch

import tinyengine.kernels.attention.triton as ta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: 1e-4 if DEVICE == "cuda" else 2e-5,  # GPU: 3xTF32 dots (dot_precision)
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}  # relative Frobenius


class Batch:
    """A random varlen batch over a randomly permuted paged cache."""

    def __init__(
        self, q_lens: list[int], seq_lens: list[int], *, num_q_heads: int, num_kv_heads: int,
        head_dim_k: int, head_dim_v: int, block_size: int, dtype: torch.dtype,
        pad_rows: int = 0, seed: int = 0, device: str = DEVICE,
    ) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens, self.dtype = q_lens, seq_lens, dtype
        blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 2  # + one poison block + one spare
        max_blocks = max(max(blocks_per_seq), 1) + 1
        shape_k = (num_blocks, block_size, num_kv_heads, head_dim_k)
        shape_v = (num_blocks, block_size, num_kv_heads, head_dim_v)
        nan = float("nan")
        self.k_cache = torch.full(shape_k, nan).to(dtype)
        self.v_cache = torch.full(shape_v, nan).to(dtype)
        poison = num_blocks - 1
        perm = torch.randperm(num_blocks - 1, generator=g).tolist()
        self.block_tables = torch.full((len(seq_lens), max_blocks), poison, dtype=torch.int32)
        self.keys, self.values = [], []  # dense fp32 context per sequence
        for i, (s, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
            ids, perm = perm[:nb], perm[nb:]
            self.block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(s, num_kv_heads, head_dim_k, generator=g).to(dtype)
            v = torch.randn(s, num_kv_heads, head_dim_v, generator=g).to(dtype)
            for p in range(s):
                self.k_cache[ids[p // block_size], p % block_size] = k[p]
                self.v_cache[ids[p // block_size], p % block_size] = v[p]
            self.keys.append(k.double())
            self.values.append(v.double())
        total = sum(q_lens)
        self.num_tokens = total + pad_rows
        self.q = torch.randn(self.num_tokens, num_q_heads, head_dim_k, generator=g).to(dtype)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.qsl_cpu = starts
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = head_dim_k**-0.5
        for name in ("k_cache", "v_cache", "block_tables", "q", "query_start_loc", "seq_lens_t"):
            setattr(self, name, getattr(self, name).to(device))

    def dense_reference(self) -> torch.Tensor:
        """Naive causal attention per sequence in float64; padding rows zero."""
        hq, hkv = self.q.shape[1], self.k_cache.shape[2]
        out = torch.zeros(self.num_tokens, hq, self.v_cache.shape[3], dtype=torch.float64)
        q = self.q.double().cpu()
        for i, (n, s) in enumerate(zip(self.q_lens, self.seq_lens, strict=True)):
            if n == 0:
                continue
            k = self.keys[i].repeat_interleave(hq // hkv, dim=1)
            v = self.values[i].repeat_interleave(hq // hkv, dim=1)
            qi = q[self.qsl_cpu[i] : self.qsl_cpu[i + 1]]
            scores = torch.einsum("qhd,khd->hqk", qi, k) * self.scale
            q_pos = torch.arange(s - n, s)[:, None]
            scores.masked_fill_(torch.arange(s)[None, :] > q_pos, float("-inf"))
            out[self.qsl_cpu[i] : self.qsl_cpu[i + 1]] = torch.einsum(
                "hqk,khd->qhd", scores.softmax(-1), v
            )
        return out

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens_t, self.scale)  # fmt: skip

    def run(self, **kw) -> torch.Tensor:  # noqa: ANN003
        return ta.paged_attention(
            *self.args(), max_query_len=max(self.q_lens), max_seq_len=max(self.seq_lens),
            query_start_loc_cpu=self.qsl_cpu, seq_lens_cpu=self.seq_lens, **kw,
        )  # fmt: skip

    def empty_out(self) -> torch.Tensor:
        # NaN-poisoned: any row a kernel forgets to write fails the comparison.
        shape = (self.num_tokens, self.q.shape[1], self.v_cache.shape[3])
        return torch.full(shape, float("nan"), dtype=self.dtype, device=self.q.device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.double().cpu()
    assert not out.isnan().any(), "NaN in output: a read outside the context or an unwritten row"
    err = (out - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


def check_against_torch_reference(batch: Batch, out: torch.Tensor) -> None:
    import tinyengine.kernels.attention.reference as attention

    ref = attention.paged_attention(
        *batch.args(), max_query_len=max(batch.q_lens), max_seq_len=max(batch.seq_lens),
        query_start_loc_cpu=batch.qsl_cpu, seq_lens_cpu=batch.seq_lens,
    )  # fmt: skip
    assert_close(out, ref.double().cpu(), batch.dtype)
