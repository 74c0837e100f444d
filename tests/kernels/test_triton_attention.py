"""Triton paged attention vs a naive dense reference written here (and vs
tinyengine/kernels/attention/reference.py, the torch reference op, when it exists).

CPU runs go through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which costs ~2 ms per program instance: shapes stay tiny
and tile sizes small so that several KV/Q tiles, block boundaries and splits
are still crossed. Unused cache slots and block-table padding point at NaN, so
any read outside a sequence's context shows up as NaN in the output.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyengine.kernels.attention.triton as ta
from tinyengine.kernels.workspace import Workspace

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


# ----------------------------------------------------------------------------- prefill / mixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_reference(dtype: torch.dtype) -> None:
    # A whole prompt, a chunk after a cached prefix, a decode row, padding rows.
    b = Batch([19, 7, 1], [19, 30, 25], num_q_heads=4, num_kv_heads=2, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=dtype, pad_rows=3)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=19,
                         block_m=16, block_n=16)  # fmt: skip
    n = sum(b.q_lens)
    assert_close(out[:n], b.dense_reference()[:n], dtype)
    full = b.run()  # the public op: padding rows come back as zeros
    assert_close(full, b.dense_reference(), dtype)
    assert (full[n:] == 0).all()
    check_against_torch_reference(b, full)


@pytest.mark.parametrize(
    "head_dim_k,head_dim_v,group", [(64, 64, 1), (128, 128, 4), (192, 128, 1), (64, 32, 3)]
)
def test_prefill_head_dims(head_dim_k: int, head_dim_v: int, group: int) -> None:
    b = Batch([12, 5], [12, 21], num_q_heads=group, num_kv_heads=1, head_dim_k=head_dim_k,
              head_dim_v=head_dim_v, block_size=16, dtype=torch.float16)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=12,
                         block_m=16, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float16)


def test_wide_gqa_group() -> None:
    # MQA-like: 32 query heads on one KV head; a tile holds 4 tokens x 32 heads.
    b = Batch([5, 1], [9, 30], num_q_heads=32, num_kv_heads=1, head_dim_k=16, head_dim_v=16,
              block_size=8, dtype=torch.float16)  # fmt: skip
    assert_close(b.run(), b.dense_reference(), torch.float16)


def test_prefill_diagonal_at_tile_edges() -> None:
    # Cached prefixes of 14..17 tokens put a q tile's first row just before,
    # on and after a 16-key tile edge: the unmasked/masked loop split must
    # never let a row see its future.
    b = Batch([3, 3, 3, 3], [17, 18, 19, 20], num_q_heads=2, num_kv_heads=1, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_query_len=3,
                         block_m=16, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float32)


def test_prefill_default_config_whole_prompt() -> None:
    # The production tile config (BLOCK_M 256 = 128 tokens x 2 heads, BLOCK_N
    # 64) on one prompt long enough for two q tiles and unmasked KV tiles.
    b = Batch([200], [200], num_q_heads=2, num_kv_heads=1, head_dim_k=32, head_dim_v=32,
              block_size=16, dtype=torch.bfloat16)  # fmt: skip
    assert_close(b.run(), b.dense_reference(), torch.bfloat16)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_seqs=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    num_kv_heads=st.sampled_from([1, 2]),
    block_size=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_prefill_random_ragged(
    data: st.DataObject, num_seqs: int, group: int, num_kv_heads: int, block_size: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    q_lens = data.draw(st.lists(st.integers(0, 24), min_size=num_seqs, max_size=num_seqs))
    if max(q_lens) == 0:
        q_lens[0] = 1
    ctx = data.draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs))
    seq_lens = [max(q + c, 1) for q, c in zip(q_lens, ctx, strict=True)]
    pad_rows = data.draw(st.integers(0, 3))
    b = Batch(q_lens, seq_lens, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
              head_dim_k=32, head_dim_v=32, block_size=block_size, dtype=dtype,
              pad_rows=pad_rows, seed=data.draw(st.integers(0, 1000)))  # fmt: skip
    block_m = data.draw(st.sampled_from([16, 32]))
    out = b.empty_out()
    ta.prefill_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:],
                         max_query_len=max(q_lens), block_m=block_m, block_n=16)  # fmt: skip
    n = sum(q_lens)
    if n:
        assert_close(out[:n], b.dense_reference()[:n], dtype)


# ----------------------------------------------------------------------------- split-KV decode


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_splits_match_reference(num_splits: int, dtype: torch.dtype) -> None:
    # Lengths straddle block and tile edges; 8 splits is more than the short
    # sequences need, so some programs find their split past the end.
    seq_lens = [1, 17, 70]
    b = Batch([1, 1, 1], seq_lens, num_q_heads=8, num_kv_heads=2, head_dim_k=32, head_dim_v=32,
              block_size=8, dtype=dtype, pad_rows=1)  # fmt: skip
    ws = Workspace("cpu")
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=70,
                        workspace=ws, num_splits=num_splits, block_n=16)  # fmt: skip
    assert_close(out[:3], b.dense_reference()[:3], dtype)
    if num_splits > 1:
        assert ws.size >= 3 * 8 * num_splits * 32 * 4  # partials came from the arena


def test_decode_without_workspace_and_public_op() -> None:
    b = Batch([1, 1], [33, 64], num_q_heads=4, num_kv_heads=1, head_dim_k=64, head_dim_v=64,
              block_size=16, dtype=torch.float16, pad_rows=2)  # fmt: skip
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=64,
                        num_splits=4, block_n=16)  # fmt: skip
    assert_close(out[:2], b.dense_reference()[:2], torch.float16)
    full = b.run(workspace=Workspace("cpu"))  # heuristic S, padding rows zeroed
    assert_close(full, b.dense_reference(), torch.float16)
    check_against_torch_reference(b, full)


def test_decode_dk_differs_from_dv() -> None:
    b = Batch([1, 1], [40, 9], num_q_heads=2, num_kv_heads=2, head_dim_k=192, head_dim_v=128,
              block_size=8, dtype=torch.float16)  # fmt: skip
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=40,
                        num_splits=3, block_n=16)  # fmt: skip
    assert_close(out, b.dense_reference(), torch.float16)


def test_decode_empty_and_zero_length_sequences() -> None:
    # A padded graph batch may carry sequences with q_len 0 or seq_len 0.
    b = Batch([1, 0, 1], [12, 5, 20], num_q_heads=2, num_kv_heads=1, head_dim_k=32,
              head_dim_v=32, block_size=8, dtype=torch.float32)  # fmt: skip
    for s in (1, 4):
        out = b.empty_out()
        ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=20,
                            num_splits=s, block_n=16)  # fmt: skip
        assert_close(out, b.dense_reference(), torch.float32)
    b.seq_lens_t[0] = 0  # an empty context attends to nothing: zeros, never NaN
    out = b.empty_out()
    ta.decode_attention(b.q, b.k_cache, b.v_cache, out, *b.args()[3:], max_seq_len=20,
                        num_splits=2, block_n=16)  # fmt: skip
    assert (out[0] == 0).all()


def test_decode_num_splits_heuristic() -> None:
    # Big batches fill the GPU alone; small ones split, bounded by the length.
    assert ta.decode_num_splits(64, 8, 4096, 132) == 1
    assert ta.decode_num_splits(256, 8, 32768, 132) == 1
    s = ta.decode_num_splits(1, 8, 4096, 132)
    assert 1 < s <= 4096 // 256
    assert ta.decode_num_splits(1, 8, 100, 132) == 1
    assert ta.decode_num_splits(4, 8, 1 << 20, 132) <= 64


def test_op_set_shape() -> None:
    from tinyengine.kernels import triton_ops

    ops = triton_ops("cpu")
    assert ops.name == "triton"
    assert ops.paged_attention is ta.paged_attention
    assert ops.write_kv_cache is ta.write_kv_cache


# ----------------------------------------------------------------------------- GPU


def _sdpa_reference(b: Batch) -> torch.Tensor:
    """torch SDPA per sequence on a contiguous copy of the context (bf16 in, fp32 math off)."""
    hq, hkv = b.q.shape[1], b.k_cache.shape[2]
    out = torch.zeros(b.num_tokens, hq, b.v_cache.shape[3], dtype=b.dtype, device=b.q.device)
    for i, (n, s) in enumerate(zip(b.q_lens, b.seq_lens, strict=True)):
        k = b.keys[i].to(b.q.device, b.dtype).transpose(0, 1)[None]
        v = b.values[i].to(b.q.device, b.dtype).transpose(0, 1)[None]
        q = b.q[b.qsl_cpu[i] : b.qsl_cpu[i + 1]].transpose(0, 1)[None]
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        mask = (
            torch.arange(s, device=q.device)[None, :]
            <= torch.arange(s - n, s, device=q.device)[:, None]
        )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale)
        out[b.qsl_cpu[i] : b.qsl_cpu[i + 1]] = o[0].transpose(0, 1)
    return out


def _fast_batch(q_lens: list[int], seq_lens: list[int], block_size: int = 16) -> Batch:
    """A realistic bf16 batch built on the GPU directly (Batch's slot loop is
    too slow for 64 x 4096 tokens): contiguous random blocks, shuffled table."""
    b = Batch.__new__(Batch)
    hq, hkv, d = 32, 8, 128
    dev, dtype = "cuda", torch.bfloat16
    b.q_lens, b.seq_lens, b.dtype, b.scale = q_lens, seq_lens, dtype, d**-0.5
    nb = [math.ceil(s / block_size) for s in seq_lens]
    total_blocks = sum(nb)
    b.k_cache = torch.randn(total_blocks, block_size, hkv, d, device=dev, dtype=dtype)
    b.v_cache = torch.randn(total_blocks, block_size, hkv, d, device=dev, dtype=dtype)
    perm = torch.randperm(total_blocks, device=dev).int()
    b.block_tables = torch.zeros(len(seq_lens), max(nb), dtype=torch.int32, device=dev)
    b.keys, b.values, off = [], [], 0
    for i, (s, n) in enumerate(zip(seq_lens, nb, strict=True)):
        ids = perm[off : off + n]
        off += n
        b.block_tables[i, :n] = ids
        b.keys.append(b.k_cache[ids.long()].flatten(0, 1)[:s])
        b.values.append(b.v_cache[ids.long()].flatten(0, 1)[:s])
    b.num_tokens = sum(q_lens)
    b.q = torch.randn(b.num_tokens, hq, d, device=dev, dtype=dtype)
    b.qsl_cpu = [0]
    for n in q_lens:
        b.qsl_cpu.append(b.qsl_cpu[-1] + n)
    b.query_start_loc = torch.tensor(b.qsl_cpu, dtype=torch.int32, device=dev)
    b.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return b


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
def test_gpu_decode_batch64_ctx4096() -> None:
    b = _fast_batch([1] * 64, [4096 - 37 * i for i in range(64)])
    ws = Workspace("cuda")
    out = b.run(workspace=ws)
    assert _rel_err(out, _sdpa_reference(b)) < 1e-2
    for s in (2, 7):  # forced splits, the reduce path
        forced = torch.empty_like(out)
        ta.decode_attention(*b.args()[:3], forced, *b.args()[3:], max_seq_len=4096,
                            workspace=ws, num_splits=s)  # fmt: skip
        assert _rel_err(forced, out) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_small_batch_splits() -> None:
    b = _fast_batch([1] * 2, [32768, 1000])
    out = b.run(workspace=Workspace("cuda"))
    assert _rel_err(out, _sdpa_reference(b)) < 1e-2


@pytest.mark.gpu
def test_gpu_prefill_2k_and_mixed() -> None:
    b = _fast_batch([2048], [2048])
    assert _rel_err(b.run(), _sdpa_reference(b)) < 1e-2
    # Chunk after a prefix + decode rows + a whole prompt in one launch.
    b = _fast_batch([512, 1, 1, 300], [1536, 900, 17, 300])
    assert _rel_err(b.run(), _sdpa_reference(b)) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay() -> None:
    # Capture one decode step at max_seq_len = "max_model_len", then change the
    # lengths and block tables in place (as the runner does) and replay: the
    # graph must follow the new metadata, with splits past short contexts idle.
    max_model_len, batch = 4096, 8
    b = _fast_batch([1] * batch, [max_model_len] * batch)
    ws = Workspace("cuda")

    def step() -> torch.Tensor:
        return ta.paged_attention(
            *b.args(), max_query_len=1, max_seq_len=max_model_len,
            query_start_loc_cpu=b.qsl_cpu, workspace=ws,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels and sizes the workspace before capture
    torch.cuda.current_stream().wait_stream(side)
    ws.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    new_lens = [1, 17, 300, 4096, 2049, 64, 1000, 3]
    b.seq_lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
    b.block_tables.copy_(b.block_tables[torch.randperm(batch, device="cuda")])
    graph.replay()
    torch.cuda.synchronize()
    b.seq_lens = new_lens
    bs = b.k_cache.shape[1]
    for i, s in enumerate(new_lens):  # rebuild the dense contexts for the reference
        ids = b.block_tables[i, : math.ceil(s / bs)].long()
        b.keys[i] = b.k_cache[ids].flatten(0, 1)[:s]
        b.values[i] = b.v_cache[ids].flatten(0, 1)[:s]
    assert _rel_err(graph_out, _sdpa_reference(b)) < 1e-2


def test_int32_offsets_only_when_the_strided_view_fits():
    """K and V share the rows of one allocation (tinyengine/worker/kv_cache.py), so a K view of
    N elements reaches offsets up to ~2N: the int32 address path must be
    chosen from the largest reachable offset, not from numel()."""
    from tinyengine.kernels.attention.triton import _offsets_fit_32

    def caches(num_blocks: int):
        storage = torch.empty(
            (2, num_blocks, 16, 8, 256), device="meta"
        )  # [L, blocks, bs, H, Dk+Dv]
        return storage[1, ..., :128], storage[1, ..., 128:]

    k, v = caches(2**31 // (16 * 8 * 256) + 1)  # the K view itself holds ~2^30 elements
    assert k.numel() < 2**31 and not _offsets_fit_32(k, v)
    k, v = caches(2**30 // (16 * 8 * 256))
    assert _offsets_fit_32(k, v)


def test_prefill_config_fp32_tiles_need_no_more_shared_memory_than_bf16():
    """fp32 (tests, references on the GPU) halves rows and keys, so its K/V
    ring and Q tile take at most the bf16 tiles' bytes (which fit an SM);
    a tile still holds at least one token's query heads."""
    for head_dim in (64, 80, 128, 256):
        for q_len in (1, 40, 1000):
            for group in (1, 4, 16):
                m2, n2, _, s2 = ta.prefill_config(head_dim, q_len, group, 2)
                m4, n4, _, s4 = ta.prefill_config(head_dim, q_len, group, 4)
                assert m4 >= group and s4 == s2
                assert (m4 + s4 * n4) * 4 <= (m2 + s2 * n2) * 2 or m4 == max(group, 16)
