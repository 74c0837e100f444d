"""Triton paged attention on a CUDA GPU at realistic sizes (bf16, 32 query
heads on 8 KV heads, contexts up to 32k) vs torch SDPA, and decode under
CUDA-graph replay with metadata changed in place. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import tinyengine.kernels.attention.triton as ta
from tests.kernels.attention_batch import Batch
from tinyengine.kernels.workspace import Workspace

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
