"""Triton MLA decode (kernels/triton_mla.py) vs the torch reference
(kernels/mla.py) and a float64 per-sequence reference written here.

CPU runs go through the Triton interpreter (~2 ms per program instance), so
shapes stay tiny: L=32, R=16, 16-row cache blocks, contexts up to ~70 tokens,
with BLOCK_N=16 so several tiles, block boundaries and splits are crossed.
Cache slots no sequence owns, and block-table padding, hold NaN: any read
outside a sequence's context shows up as NaN in the output.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import mla as mla_ref
from kernels import triton_mla
from kernels.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: 2e-3 if DEVICE == "cuda" else 2e-5,
    torch.bfloat16: 2e-2,
}  # relative Frobenius


class LatentBatch:
    """Random decode queries over a randomly permuted, NaN-poisoned latent cache."""

    def __init__(
        self, seq_lens: list[int], *, heads: int, latent: int = 32, rope: int = 16,
        block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
        device: str = DEVICE,
    ) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.latent = seq_lens, latent
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks) + 2  # + a poison block + a spare
        poison = num_blocks - 1
        cache = torch.full((num_blocks, block_size, 1, latent + rope), float("nan"))
        table = torch.full((len(seq_lens), max(blocks) + 1), poison, dtype=torch.int32)
        perm = torch.randperm(num_blocks - 1, generator=g).tolist()
        self.rows = []  # dense fp64 context per sequence, after the dtype round trip
        for i, (s, nb) in enumerate(zip(seq_lens, blocks, strict=True)):
            ids, perm = perm[:nb], perm[nb:]
            table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
            rows = torch.randn(s, latent + rope, generator=g).to(dtype)
            for p in range(s):
                cache[ids[p // block_size], p % block_size, 0] = rows[p].float()
            self.rows.append(rows.double())
        self.cache = cache.to(dtype).to(device)
        self.block_tables = table.to(device)
        self.q_latent = torch.randn(len(seq_lens), heads, latent, generator=g).to(dtype).to(device)
        self.q_rope = torch.randn(len(seq_lens), heads, rope, generator=g).to(dtype).to(device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.scale = (latent + rope) ** -0.5

    def args(self) -> tuple:
        return (self.q_latent, self.q_rope, self.cache, self.block_tables, self.seq_lens_t,
                self.scale)  # fmt: skip

    def dense_reference(self) -> torch.Tensor:
        ql, qr = self.q_latent.double().cpu(), self.q_rope.double().cpu()
        out = []
        for i, rows in enumerate(self.rows):
            lat, rope = rows[:, : self.latent], rows[:, self.latent :]
            scores = (ql[i] @ lat.T + qr[i] @ rope.T) * self.scale
            out.append(scores.softmax(-1) @ lat)
        return torch.stack(out)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not out.isnan().any(), "NaN in output: a read outside the context"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_ragged_batch_matches_references(dtype: torch.dtype, num_splits: int) -> None:
    # 5 (< one block), 70 (4.4 blocks), 33 (just past 2 blocks), 16 (exactly one);
    # 8 splits of 70 tokens in 16-row tiles: splits 5.. are empty for every sequence.
    b = LatentBatch([5, 70, 33, 16], heads=4, dtype=dtype)
    out = triton_mla.mla_decode(*b.args(), max_seq_len=70, num_splits=num_splits, block_n=16)
    assert out.shape == b.q_latent.shape and out.dtype == dtype
    assert rel_err(out, b.dense_reference()) < TOL[dtype]
    # The reference reads whole blocks and masks scores, so 0 * NaN would poison
    # it: hand it the cache with the poison replaced by (large) finite garbage.
    q_lat, q_rope, cache, *rest = b.args()
    ref = mla_ref.mla_decode(q_lat, q_rope, cache.nan_to_num(nan=1e3), *rest, max_seq_len=70)
    assert rel_err(out, ref) < TOL[dtype]


def test_workspace_path_and_heuristic_split_count() -> None:
    b = LatentBatch([40, 9, 70], heads=3, seed=1)
    ws = Workspace(DEVICE)
    ref = b.dense_reference()
    out_ws = triton_mla.mla_decode(
        *b.args(), max_seq_len=70, workspace=ws, num_splits=4, block_n=16
    )
    assert ws.stats.num_growths == 1  # the partials came from the arena
    out_none = triton_mla.mla_decode(*b.args(), max_seq_len=70, num_splits=4, block_n=16)
    assert torch.equal(out_ws, out_none)
    assert rel_err(out_ws, ref) < TOL[torch.float32]
    out_auto = triton_mla.mla_decode(*b.args(), max_seq_len=70, workspace=ws)  # default tiles
    assert rel_err(out_auto, ref) < TOL[torch.float32]


def test_non_power_of_two_latent_and_head_block_tail() -> None:
    # L=40 pads to a 64-wide tile; 5 heads with block_h 16 leaves 11 masked rows.
    b = LatentBatch([23, 50], heads=5, latent=40, rope=24, block_size=8, seed=2)
    out = triton_mla.mla_decode(*b.args(), max_seq_len=50, num_splits=2, block_n=16)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


def test_split_count_from_host_ints_only() -> None:
    s = triton_mla.mla_num_splits
    assert s(64, 128, 4096, 132) == 1  # 512 programs >= 2 per SM
    assert s(1, 16, 4096, 132) == 16  # capped by 256-token splits
    assert s(1, 16, 100, 132) == 1
    assert s(1, 128, 1 << 20, 132) <= triton_mla.MAX_SPLITS


def test_rejects_mismatched_widths() -> None:
    b = LatentBatch([5], heads=2)
    with pytest.raises(ValueError, match="L \\+ R"):
        triton_mla.mla_decode(b.q_latent, b.q_rope[..., :8], b.cache, b.block_tables,
                              b.seq_lens_t, b.scale, max_seq_len=5)  # fmt: skip


# ----------------------------------------------------------------------------- GPU


def _deepseek_batch(batch: int, heads: int, ctx: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    block_size, latent, rope = 64, 512, 64
    blocks = batch * ctx // block_size + 1
    cache = torch.randn(blocks, block_size, 1, latent + rope, device="cuda", generator=g).to(dtype)
    table = torch.randperm(blocks - 1, device="cuda", generator=g)[: batch * (ctx // block_size)]
    table = table.view(batch, ctx // block_size).int()
    ql = torch.randn(batch, heads, latent, device="cuda", generator=g).to(dtype)
    qr = torch.randn(batch, heads, rope, device="cuda", generator=g).to(dtype)
    lens = torch.randint(1, ctx + 1, (batch,), device="cuda", generator=g).int()
    lens[0] = ctx
    return ql, qr, cache, table, lens, (latent + rope) ** -0.5


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
def test_gpu_deepseek_v3_dims(heads: int) -> None:
    args = _deepseek_batch(64, heads, 4096, torch.bfloat16)
    ref = mla_ref.mla_decode(*args, max_seq_len=4096)
    out = triton_mla.mla_decode(*args, max_seq_len=4096, workspace=Workspace("cuda"))
    assert rel_err(out, ref) < 2e-2
    for splits in (1, 7, 64):
        out = triton_mla.mla_decode(*args, max_seq_len=4096, num_splits=splits)
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay() -> None:
    # Capture with one set of lengths, replay with others (incl. 1 and the max):
    # the captured grid must follow the device-side seq_lens.
    ql, qr, cache, table, lens, scale = _deepseek_batch(4, 16, 4096, torch.bfloat16)
    ws = Workspace("cuda")
    step = lambda: triton_mla.mla_decode(ql, qr, cache, table, lens, scale,  # noqa: E731
                                         max_seq_len=4096, workspace=ws)  # fmt: skip
    step()  # warmup: compiles, sizes the arena
    torch.cuda.synchronize()
    ws.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for new in ([1, 4096, 17, 2000], [4096, 4096, 4096, 4096], [3, 5, 64, 65]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        ql.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = mla_ref.mla_decode(ql, qr, cache, table, lens, scale, max_seq_len=4096)
        assert rel_err(graph_out, ref) < 2e-2
