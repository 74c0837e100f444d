"""Triton MLA decode (tinyengine/kernels/mla/triton.py) vs the torch reference
(tinyengine/kernels/mla/reference.py) and a float64 per-sequence reference written here.

CPU runs go through the Triton interpreter (~2 ms per program instance), so
shapes stay tiny: L=32, R=16, 16-row cache blocks, contexts up to ~70 tokens,
with BLOCK_N=16/32 so several tiles, block boundaries and splits are crossed.
Every kernel path is pinned through mla_decode's overrides: head blocks of
16/32/64 (with head counts that leave a partial block), BLOCK_N 16/32/64, the
direct (one split) and split+reduce paths, whole tiles through TMA
descriptors (cache blocks a multiple of BLOCK_N) or rows through pointers,
lazy and eager rescaling. Cache slots no sequence owns, and block-table
padding, hold NaN: any read outside a sequence's context shows up as NaN in
the output.
"""

from __future__ import annotations

import math

import pytest
import torch

import tinyengine.kernels.mla.reference as mla_ref
import tinyengine.kernels.mla.triton as triton_mla
from tinyengine.kernels.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: 1e-4 if DEVICE == "cuda" else 2e-5,  # GPU: 3xTF32 dots (dot_precision)
    torch.bfloat16: 2e-2,
}  # relative Frobenius


class LatentBatch:
    """Random decode queries over a randomly permuted, NaN-poisoned latent cache.

    `ramp` multiplies row p's latent and rope by (1 + ramp * p): scores then
    grow along the context, so the running max moves many times (lazy
    rescaling takes both of its branches)."""

    def __init__(
        self, seq_lens: list[int], *, heads: int, latent: int = 32, rope: int = 16,
        block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
        q_scale: float = 1.0, ramp: float = 0.0, device: str = DEVICE,
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
            rows = torch.randn(s, latent + rope, generator=g)
            rows *= 1 + ramp * torch.arange(s, dtype=torch.float32)[:, None]
            rows = rows.to(dtype)
            for p in range(s):
                cache[ids[p // block_size], p % block_size, 0] = rows[p].float()
            self.rows.append(rows.double())
        self.cache = cache.to(dtype).to(device)
        self.block_tables = table.to(device)
        q_lat = torch.randn(len(seq_lens), heads, latent, generator=g) * q_scale
        q_rope = torch.randn(len(seq_lens), heads, rope, generator=g) * q_scale
        self.q_latent = q_lat.to(dtype).to(device)
        self.q_rope = q_rope.to(dtype).to(device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_seq_len = max(seq_lens)
        self.scale = (latent + rope) ** -0.5

    def args(self) -> tuple:
        return (self.q_latent, self.q_rope, self.cache, self.block_tables, self.seq_lens_t,
                self.scale)  # fmt: skip

    def run(self, **overrides) -> torch.Tensor:
        return triton_mla.launch_mla_decode(*self.args(), max_seq_len=self.max_seq_len, **overrides)

    def dense_reference(self) -> torch.Tensor:
        """fp64 softmax attention per sequence; an empty context gives 0."""
        ql, qr = self.q_latent.double().cpu(), self.q_rope.double().cpu()
        out = []
        for i, rows in enumerate(self.rows):
            if len(rows) == 0:
                out.append(torch.zeros(ql.shape[1], self.latent, dtype=torch.float64))
                continue
            lat, rope = rows[:, : self.latent], rows[:, self.latent :]
            scores = (ql[i] @ lat.T + qr[i] @ rope.T) * self.scale
            out.append(scores.softmax(-1) @ lat)
        return torch.stack(out)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not out.isnan().any(), "NaN in output: a read outside the context"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# (block_h, block_n, num_splits, lazy_rescale, paged_tma, block_size): every
# loop shape. paged_tma: whole tiles through TMA descriptors (interpreted on
# CPU), a split's partial last tile through pointers.
PATHS = [
    (16, 16, 1, False, False, 16),  # the smallest tiles, direct, eager rescale
    (16, 32, 3, True, False, 16),  # 32-row tiles straddle 16-row blocks
    (32, 16, 2, True, False, 16),
    (64, 16, 1, True, False, 16),
    (64, 64, 8, True, False, 16),  # 8 splits of 70 tokens in 64-row tiles: most are empty
    (64, 32, 3, False, False, 16),
    (16, 16, 1, False, True, 16),  # TMA: one tile per cache block
    (64, 16, 2, False, True, 32),  # TMA: two tiles per cache block
    (64, 32, 3, True, True, 32),
    (32, 64, 1, False, True, 64),  # TMA: one 64-row page per tile (DeepSeek on CUDA)
    (64, 64, 8, False, True, 64),
]


@pytest.mark.parametrize(("block_h", "block_n", "splits", "lazy", "tma", "block_size"), PATHS)
def test_paths_match_reference(
    block_h: int, block_n: int, splits: int, lazy: bool, tma: bool, block_size: int
) -> None:
    # 5 (< one tile), 70 (4.4 16-row tiles), 33 (just past 2), 16 (exactly
    # one); 20 heads leave a partial head block at every block_h.
    b = LatentBatch([5, 70, 33, 16], heads=20, block_size=block_size, seed=block_h + block_n)
    out = b.run(
        num_splits=splits, block_h=block_h, block_n=block_n, lazy_rescale=lazy, paged_tma=tma
    )
    assert out.shape == b.q_latent.shape and out.dtype == torch.float32
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_batch_matches_references(dtype: torch.dtype, num_splits: int) -> None:
    b = LatentBatch([5, 70, 33, 16], heads=4, dtype=dtype)
    for tma in (False, True):
        out = b.run(num_splits=num_splits, block_n=16, paged_tma=tma)
        assert out.shape == b.q_latent.shape and out.dtype == dtype
        assert rel_err(out, b.dense_reference()) < TOL[dtype]
        # The reference reads whole blocks and masks scores, so 0 * NaN would
        # poison it: hand it the cache with the poison replaced by (large)
        # finite garbage.
        q_lat, q_rope, cache, *rest = b.args()
        ref = mla_ref.mla_decode(q_lat, q_rope, cache.nan_to_num(nan=1e3), *rest, max_seq_len=70)
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("lazy", [True, False])
def test_growing_scores_rescale(lazy: bool, tma: bool) -> None:
    # Scores spread over ~50 log2 units and grow along the context: with
    # 16-row tiles the running max outgrows the lazy threshold (8) in some
    # tiles (e.g. tiles 0, 2, 3, 4 of the unsplit first sequence) and not in
    # others, which then take weights against a stale max (up to 2^8).
    b = LatentBatch([70, 41], heads=8, q_scale=3.0, ramp=0.02, seed=3)
    kw = dict(block_n=16, lazy_rescale=lazy, paged_tma=tma)
    out = b.run(num_splits=2, block_h=64, **kw)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]
    out = b.run(num_splits=1, block_h=16, **kw)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_zero_length_padding_rows(splits: int, tma: bool) -> None:
    # A CUDA graph padded to its capture size runs rows with seq_len 0: they
    # must come out as zeros (and not poison the real rows), split or not.
    b = LatentBatch([0, 37, 0, 16], heads=5, seed=4)
    out = b.run(num_splits=splits, block_h=64, block_n=16, paged_tma=tma)
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


def test_tiles_straddle_small_cache_blocks() -> None:
    # block_size 4: a 32-row tile spans 8 cache blocks, each row looks up its
    # own; TMA cannot load such a tile in one copy, so asking for it changes
    # nothing (the launcher falls back to pointers).
    b = LatentBatch([3, 30, 45], heads=6, block_size=4, seed=5)
    for tma in (False, True):
        out = b.run(num_splits=2, block_h=64, block_n=32, paged_tma=tma)
        assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


@pytest.mark.parametrize("block_h", [16, 64])
def test_non_power_of_two_latent_and_rope(block_h: int) -> None:
    # L=40 pads to a 64-wide tile, R=24 to 32 (TMA: the descriptor's zero
    # fill past the view's edge); 5 heads leave masked rows.
    b = LatentBatch([23, 50], heads=5, latent=40, rope=24, block_size=16, seed=2)
    out = b.run(num_splits=2, block_h=block_h, block_n=16)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]
    out = b.run(num_splits=1, block_h=block_h, block_n=16, paged_tma=True)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]
    out = b.run(num_splits=1, block_h=block_h, block_n=32)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


def test_tma_falls_back_where_rows_are_unaligned() -> None:
    # 33 + 16 fp32 columns: a 196-byte row stride, which TMA cannot address
    # (16-byte multiples only): asked for TMA, the launcher loads through
    # pointers and the result is still right.
    b = LatentBatch([23, 50], heads=5, latent=33, rope=16, block_size=16, seed=7)
    out = b.run(num_splits=2, block_h=16, block_n=16, paged_tma=True)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


def test_deepseek_widths_tiny_context() -> None:
    # The real L=512 / R=64 tile widths with the default configuration
    # (fp32: 32 heads per program, 32-row tiles) on a context of a few tiles,
    # and with the bf16 default's 64 x 64 tiles through TMA pages.
    b = LatentBatch([3, 40, 64], heads=64, latent=512, rope=64, block_size=64, seed=6)
    assert rel_err(b.run(), b.dense_reference()) < TOL[torch.float32]
    out = b.run(num_splits=2, block_h=64, block_n=64, paged_tma=True, lazy_rescale=False)
    assert rel_err(out, b.dense_reference()) < TOL[torch.float32]


def test_workspace_path_and_default_config() -> None:
    b = LatentBatch([40, 9, 70], heads=3, seed=1)
    ws = Workspace(DEVICE)
    ref = b.dense_reference()
    out_ws = b.run(workspace=ws, num_splits=4, block_n=16)
    assert ws.stats.num_growths == 1  # the partials came from the arena
    out_none = b.run(num_splits=4, block_n=16)
    assert torch.equal(out_ws, out_none)
    assert rel_err(out_ws, ref) < TOL[torch.float32]
    out_auto = b.run(workspace=ws)  # mla_config's choices
    assert rel_err(out_auto, ref) < TOL[torch.float32]


# ----------------------------------------------------------------------------- config


def test_config_for_deepseek_v3() -> None:
    cfg = triton_mla.mla_config
    c = cfg(64, 128, 512, 4096, 132, 2, 64)  # bf16, 64-token cache blocks
    assert (c.block_h, c.block_n, c.num_warps, c.num_splits) == (64, 64, 8, 1)  # one full wave
    assert c.paged_tma and not c.lazy_rescale  # whole pages by TMA, eager rescale
    c16 = cfg(64, 128, 512, 4096, 132, 2, 16)  # 16-token blocks: tiles straddle them
    assert not c16.paged_tma and c16.lazy_rescale and c16[:5] == c[:2] + (8, 2, 1)
    assert not cfg(64, 128, 512, 4096, 132, 4, 64).paged_tma  # fp32: pointers
    assert cfg(256, 128, 512, 4096, 132)[4] == 1
    assert cfg(8, 128, 512, 4096, 132)[4] > 1  # 16 programs would idle most SMs
    assert cfg(1, 128, 512, 4096, 132)[4] > cfg(8, 128, 512, 4096, 132)[4]
    shard = cfg(64, 16, 512, 4096, 132, 2, 64)  # a 16-head (TP-8) shard
    assert (shard.block_h, shard.block_n, shard.num_stages, shard.paged_tma) == (16, 32, 3, True)
    assert not cfg(64, 32, 512, 4096, 132, 2, 64).paged_tma  # no TMA tile at 32 heads


def test_config_bounded_variants_from_host_ints() -> None:
    # The compiled variant is (block_h, block_n, warps, stages, DIRECT): across
    # every batch size and context a model must compile only a few, all of them
    # reachable during warmup. num_splits itself is a runtime argument.
    for heads, latent in ((128, 512), (16, 512), (3, 32)):
        variants = set()
        for batch in range(1, 257):
            for ctx in (1, 17, 64, 1000, 4096, 32768, 163840):
                c = triton_mla.mla_config(batch, heads, latent, ctx, 132, 2, 64)
                assert 1 <= c.num_splits <= triton_mla.MAX_SPLITS
                assert c.num_splits == 1 or ctx // c.num_splits >= triton_mla._MIN_SPLIT_TOKENS
                variants.add(c._replace(num_splits=c.num_splits == 1))
        assert len({v._replace(num_splits=0) for v in variants}) == 1, variants  # one tile
        assert len(variants) <= 2, variants  # direct or split


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
        out = triton_mla.launch_mla_decode(*args, max_seq_len=4096, num_splits=splits)
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_fp32_at_deepseek_v3_widths() -> None:
    """fp32 takes half-size tiles (mla_config): the bf16 tiles in fp32 need
    more shared memory than an SM has at 128 heads x (512 + 64)."""
    args = _deepseek_batch(4, 128, 512, torch.float32)
    assert triton_mla.mla_config(4, 128, 512, 512, 132, 4, 64)[:2] == (32, 32)
    ref = mla_ref.mla_decode(*args, max_seq_len=512)
    out = triton_mla.mla_decode(*args, max_seq_len=512)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("block_h", "block_n", "warps", "stages", "tma"),
    [(64, 64, 8, 2, True), (64, 64, 8, 2, False), (64, 32, 8, 2, True), (16, 32, 4, 3, True),
     (16, 32, 4, 2, False)],
)  # fmt: skip
def test_gpu_tile_configs(block_h: int, block_n: int, warps: int, stages: int, tma: bool) -> None:
    # The candidate configurations of benchmarks/sweep_mla.py, compiled for
    # real, both rescale variants; the lengths end mid-tile (pointer tails).
    args = _deepseek_batch(8, 128, 1024, torch.bfloat16)
    ref = mla_ref.mla_decode(*args, max_seq_len=1024)
    for splits, lazy in ((1, False), (4, True), (3, False)):
        out = triton_mla.launch_mla_decode(
            *args, max_seq_len=1024, num_splits=splits, block_h=block_h, block_n=block_n,
            num_warps=warps, num_stages=stages, paged_tma=tma, lazy_rescale=lazy,
        )  # fmt: skip
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # the Triton kernel; the Gluon one (on Hopper)
def test_gpu_cuda_graph_replay(heads: int) -> None:
    # Capture with one set of lengths, replay with others (incl. 1 and the max):
    # the captured grid must follow the device-side seq_lens.
    ql, qr, cache, table, lens, scale = _deepseek_batch(4, heads, 4096, torch.bfloat16)
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


def test_engine_caches_take_the_tma_path() -> None:
    # The engine's latent caches (one allocation, a [num_blocks, block_size,
    # 1, L + R] view per layer) at DeepSeek-V3 widths: on 64-token blocks the
    # 64-row tiles of mla_config's bf16 choice can be whole-page TMA copies;
    # on 16-token blocks they cannot, and neither can a cache whose blocks do
    # not abut or whose rows are not 16-byte multiples.
    from tinyengine.models.context import KVCacheSpec
    from tinyengine.worker.kv_cache import allocate_kv_cache

    spec = KVCacheSpec(3, 1, 576, 0)
    for block_size, want in ((64, True), (128, True), (16, False)):
        caches = allocate_kv_cache(spec, 4, block_size, torch.bfloat16, "cpu")
        for k_cache, v_cache in caches:
            assert v_cache is k_cache
            assert triton_mla.pages_by_tma(k_cache, 512, 64) is want
    wide = torch.zeros(4, 64, 1, 2 * 576, dtype=torch.bfloat16)[..., :576]  # rows 2x apart
    assert triton_mla.pages_by_tma(wide, 512, 64)  # one row stride still: fine
    strided = torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16)[::2]  # blocks do not abut
    assert not triton_mla.pages_by_tma(strided, 512, 64)
    odd = torch.zeros(4, 64, 1, 33 + 16, dtype=torch.float32)  # 196-byte rows
    assert not triton_mla.pages_by_tma(odd, 33, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_gluon_split_kernel(heads: int, dtype: torch.dtype) -> None:
    # The Hopper Gluon kernel (tinyengine/kernels/mla/gluon.py) at the one shape it
    # serves, on a NaN-poisoned cache: empty rows, one row, a page +- 1, a
    # partial last tile after several whole ones; direct and split; against
    # the fp64 reference and against the Triton kernel.
    import tinyengine.kernels.mla.gluon as mla_gluon

    b = LatentBatch([0, 1, 63, 64, 65, 130, 300], heads=heads, latent=512, rope=64,
                    block_size=64, dtype=dtype, seed=11)  # fmt: skip
    assert mla_gluon.supports(b.q_latent, b.cache, 64, 64, True)  # the test means something
    ref = b.dense_reference()
    for splits in (1, 2, 3, 8):
        out = b.run(num_splits=splits, gluon=True)
        assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        triton_out = b.run(num_splits=splits, gluon=False)
        assert rel_err(out, triton_out.double()) < TOL[torch.bfloat16]
