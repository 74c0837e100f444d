"""Triton DeepSeek-V4 sparse attention (tinyengine/kernels/sparse_attention/
triton.py) vs its torch reference (sparse_attention/reference.py).

Caches are paged through randomly permuted block ids, and every slot no
query of the batch may read holds NaN: positions before a row's window,
incomplete entries, the spare entry rows, the null block that a sliding
group's table points at for blocks older than the window, table padding. A
read outside what a row may see then shows up as NaN in the kernel's
output. The reference masks scores after gathering at fixed sizes (0 * NaN
would poison it), so it gets the caches with the poison replaced by finite
garbage. Mixed steps (decode rows, chunks after a cached prefix crossing
windows and blocks, whole prompts, padding rows) run every token through the
kernel as a row of its own and are held to the same tolerance against the
reference's per-sequence path (attend_longer). CPU runs go through the
Triton interpreter, so shapes stay small (D 32-64, H 4-20 with partial head
blocks, 4- to 16-token blocks); the `gpu` tests run DeepSeek-V4-Flash's
shapes (H=64, D=512, bf16, 64-token blocks, window 128, CSA top-512 and HCA
ratio 128) and CUDA-graph replay. test_triton_v4_prefill.py has the row
model's own cases (padding rows, row blocks, long chunks on the GPU).
"""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.sparse_attention.reference as ref
import tinyengine.kernels.sparse_attention.triton as tri
from tinyengine.kernels.compressor.reference import entry_slots, token_slots
from tinyengine.kernels.workspace import Workspace
from tinyengine.models.context import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {  # (atol, rtol) per element
    torch.float32: (2e-4, 2e-4) if DEVICE == "cuda" else (2e-5, 2e-5),  # GPU: 3xTF32 dots
    torch.bfloat16: (2e-2, 2e-2),
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class V4Batch:
    """One step's queries over poisoned paged caches. `seqs` holds
    (seq_len, q_len) per sequence: q_len 1 is a decode row. two_groups: the
    entries have their own table and cache (entry_block_tables), and the
    token table points blocks older than every query's window at a null
    block; otherwise one table pages both. graph: a graph-shaped step (no
    host lengths; decode rows only)."""

    def __init__(
        self, seqs: list[tuple[int, int]], *, heads: int = 12, dim: int = 32, block_size: int = 8,
        window: int = 8, ratio: int = 0, topk: int | None = None, csa: bool = False,
        dtype: torch.dtype = torch.float32, two_groups: bool = True, graph: bool = False,
        pad_rows: int = 0, max_seq_len: int | None = None, q_scale: float = 1.0, seed: int = 0,
        device: str = DEVICE,
    ) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        bs, self.window, self.ratio = block_size, window, ratio
        lens = [s for s, _ in seqs]
        self.max_seq_len = max_seq_len or max(lens)
        width = cdiv(self.max_seq_len, bs) + 1
        # The first position any of a sequence's queries may read.
        first = [max(0, s - n - window + 1) for s, n in seqs]
        own = [
            (f // bs if two_groups else 0, cdiv(s, bs)) for f, s in zip(first, lens, strict=True)
        ]
        num_kv = sum(hi - lo for lo, hi in own) + 1
        ids = torch.randperm(num_kv, generator=g).tolist()
        null = ids.pop()
        table = torch.full((len(seqs), width), null, dtype=torch.int32)
        for i, (lo, hi) in enumerate(own):
            table[i, lo:hi] = torch.tensor(ids[: hi - lo], dtype=torch.int32)
            ids = ids[hi - lo :]
        kv = torch.randn(num_kv * bs, dim, generator=g)
        readable = torch.zeros(num_kv * bs, dtype=torch.bool)
        for i, (f, s) in enumerate(zip(first, lens, strict=True)):
            readable[token_slots(table[i], torch.arange(f, s), bs)] = True
        kv[~readable] = float("nan")
        self.kv_cache = kv.view(num_kv, bs, dim).to(dtype).to(device)
        self.block_tables = table.to(device)
        self.entry_cache = self.entry_tables = None
        if ratio:
            # One row more than the entries need, poisoned: the kernel must
            # take the rows per block from the cache, not assume them.
            rows = cdiv(bs, ratio) + 1
            etable, num_e = table, num_kv
            if two_groups:  # the full-history group: every block of the sequence, own ids
                num_e = sum(cdiv(s, bs) for s in lens) + 1
                ids = torch.randperm(num_e, generator=g).tolist()
                etable = torch.full((len(seqs), width), ids.pop(), dtype=torch.int32)
                for i, s in enumerate(lens):
                    etable[i, : cdiv(s, bs)] = torch.tensor(ids[: cdiv(s, bs)], dtype=torch.int32)
                    ids = ids[cdiv(s, bs) :]
                self.entry_tables = etable.to(device)
            ent = torch.randn(num_e * rows, dim, generator=g)
            complete = torch.zeros(ent.shape[0], dtype=torch.bool)
            for i, s in enumerate(lens):
                complete[entry_slots(etable[i], torch.arange(s // ratio), ratio, bs, rows)] = True
            ent[~complete] = float("nan")
            self.entry_cache = ent.view(-1, rows, dim).to(dtype).to(device)
        # Query rows: sequence i's q_len rows end at its seq_len; pad rows last.
        starts = [0]
        for _, n in seqs:
            starts.append(starts[-1] + n)
        self.num_tokens = starts[-1] + pad_rows
        positions = [p for (s, n) in seqs for p in range(s - n, s)]
        self.topk = None
        if csa:  # the indexer's picks: complete entries, some slots -1, shuffled
            picks = torch.full((self.num_tokens, topk), -1, dtype=torch.long)
            for t, p in enumerate(positions):
                chosen = torch.randperm((p + 1) // ratio, generator=g)[:topk]
                chosen[torch.rand(len(chosen), generator=g) < 0.2] = -1
                picks[t, : len(chosen)] = chosen
                picks[t] = picks[t, torch.randperm(topk, generator=g)]
            self.topk = picks.to(device)
        self.decode_rows = [starts[i] for i, (_, n) in enumerate(seqs) if n == 1]
        self.longer_rows = [t for i, (_, n) in enumerate(seqs) if n > 1
                            for t in range(starts[i], starts[i + 1])]  # fmt: skip
        self.pad_rows = list(range(starts[-1], self.num_tokens))
        q = torch.randn(self.num_tokens, heads, dim, generator=g) * q_scale
        self.q = q.to(dtype).to(device)
        self.sinks = torch.randn(heads, generator=g).to(device)
        self.scale = dim**-0.5
        self.attn = AttentionMetadata(
            num_tokens=self.num_tokens, num_seqs=len(seqs), max_query_len=max(n for _, n in seqs),
            max_seq_len=self.max_seq_len,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables,
            slot_mapping=torch.zeros(self.num_tokens, dtype=torch.long, device=device),
            query_start_loc_cpu=starts, seq_lens_cpu=None if graph else lens,
            entry_block_tables=self.entry_tables,
        )  # fmt: skip

    def kwargs(self, clean: bool = False) -> dict:
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.nan_to_num(nan=1e3) if clean and t is not None else t

        return dict(
            window=self.window, sinks=self.sinks, scale=self.scale,
            entry_cache=c(self.entry_cache), ratio=self.ratio, topk_indices=self.topk,
        )  # fmt: skip

    def run(self, **overrides) -> torch.Tensor:
        return tri.launch_sparse_attention(self.q, self.kv_cache, self.attn, **self.kwargs(),
                                           **overrides)  # fmt: skip

    def reference(self) -> torch.Tensor:
        clean = self.kv_cache.nan_to_num(nan=1e3)
        return ref.sparse_attention(self.q, clean, self.attn, **self.kwargs(clean=True))

    def check(self, out: torch.Tensor, expected: torch.Tensor | None = None) -> None:
        """Decode rows and the rows of longer chunks close to the reference
        (whose chunks go through its per-sequence attend_longer), padding
        rows 0, no NaN anywhere."""
        expected = self.reference() if expected is None else expected
        assert out.shape == self.q.shape and out.dtype == self.q.dtype
        assert not out.isnan().any(), "NaN in the output: a read outside what a row may see"
        atol, rtol = TOL[self.q.dtype]
        for rows in (self.decode_rows, self.longer_rows):
            torch.testing.assert_close(out[rows].float(), expected[rows].float(), atol=atol,
                                       rtol=rtol)  # fmt: skip
        assert not out[self.pad_rows].any()


def decode_seqs(lens: list[int]) -> list[tuple[int, int]]:
    return [(s, 1) for s in lens]


# Positions before the first window completes, on and around block edges,
# and a few windows in.
LENS = [1, 2, 5, 8, 9, 16, 17, 23, 31, 40, 57, 64]


@pytest.mark.parametrize(
    ("block_size", "window", "ratio", "csa", "two_groups"),
    [
        (8, 8, 0, False, True),  # window only (a sliding layer)
        (4, 5, 0, False, False),
        (8, 8, 8, False, True),  # HCA, ratio = block size
        (4, 16, 16, False, True),  # HCA, ratio > block size
        (16, 4, 8, False, False),  # HCA, one table for both
        (8, 8, 4, True, True),  # CSA
        (16, 16, 4, True, False),
        (4, 4, 4, True, True),
    ],
)
def test_decode_rows_match_reference(
    block_size: int, window: int, ratio: int, csa: bool, two_groups: bool
) -> None:
    b = V4Batch(decode_seqs(LENS), block_size=block_size, window=window, ratio=ratio,
                topk=6 if csa else None, csa=csa, two_groups=two_groups,
                seed=block_size + window)  # fmt: skip
    b.check(b.run(block_h=16, block_n=16))


@pytest.mark.parametrize(
    ("heads", "block_h", "block_n", "splits"),
    [
        (4, 16, 16, 1),  # one partial head block, direct
        (20, 16, 16, 3),  # two head blocks (the second partial), split + reduce
        (12, 32, 32, 2),
        (12, 16, 16, 9),  # more splits than tiles: most are empty
        (16, 16, 32, 4),
    ],
)
@pytest.mark.parametrize("csa", [False, True])
def test_tiles_and_splits(heads: int, block_h: int, block_n: int, splits: int, csa: bool) -> None:
    # Tiles straddle the window / entry boundary and the splits' edges.
    b = V4Batch(decode_seqs([3, 22, 41, 64, 70]), heads=heads, block_size=8, window=12,
                ratio=4 if csa else 8, topk=20 if csa else None, csa=csa,
                seed=heads + splits)  # fmt: skip
    b.check(b.run(num_splits=splits, block_h=block_h, block_n=block_n))


@pytest.mark.parametrize("csa", [False, True])
def test_empty_splits_ignore_stale_scratch(csa: bool) -> None:
    """Splits with no live key write only their -inf lse; the reduce must
    not use whatever the workspace held in their partials: here NaN in
    every byte of it."""
    b = V4Batch(decode_seqs([3, 22, 41, 64, 70]), heads=12, block_size=8, window=12,
                ratio=4 if csa else 8, topk=20 if csa else None, csa=csa, seed=5)  # fmt: skip
    ws = Workspace(b.q.device)
    b.run(num_splits=9, block_h=16, block_n=16, workspace=ws)
    ws.buffer.view(torch.uint8).fill_(0xFF)  # 0xFFFFFFFF: a float32 NaN
    b.check(b.run(num_splits=9, block_h=16, block_n=16, workspace=ws))


# Mixed steps: decode rows, chunks after a cached prefix that start and end
# mid-block and cross windows and compression boundaries, a whole prompt
# (no prefix), and padding rows. Every row goes through the kernel.
MIXED = [(19, 1), (50, 30), (7, 1), (12, 12), (33, 1), (45, 6), (64, 2)]


@pytest.mark.parametrize("two_groups", [True, False])
@pytest.mark.parametrize(
    ("block_size", "window", "ratio", "csa"),
    [(8, 8, 0, False), (8, 8, 4, True), (8, 8, 8, False), (4, 12, 16, False), (16, 5, 4, True)],
)
def test_mixed_batch(block_size: int, window: int, ratio: int, csa: bool, two_groups: bool) -> None:
    b = V4Batch(MIXED, block_size=block_size, window=window, ratio=ratio,
                topk=8 if csa else None, csa=csa, two_groups=two_groups, pad_rows=3,
                seed=block_size + ratio)  # fmt: skip
    assert len(b.longer_rows) == 50 and b.pad_rows
    b.check(b.run(num_splits=2, block_h=16, block_n=16))


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("csa", [False, True])
def test_growing_scores_rescale(csa: bool, lazy: bool) -> None:
    # Large queries spread the scores over tens of log2 units, so the
    # running max outgrows the lazy threshold in some tiles and not in others.
    b = V4Batch(decode_seqs([29, 70, 41]), heads=8, block_size=8, window=16,
                ratio=4 if csa else 8, topk=24 if csa else None, csa=csa, q_scale=6.0,
                seed=11)  # fmt: skip
    for splits in (1, 3):
        b.check(b.run(num_splits=splits, block_h=16, block_n=16, lazy_rescale=lazy))


@pytest.mark.parametrize("csa", [False, True])
def test_graph_shaped_step(csa: bool) -> None:
    # No host lengths, max_seq_len the capture's bound (above every length),
    # a padding row of length 0 (its output is 0: only the sink), and the
    # launcher's own tile and split choice.
    b = V4Batch(decode_seqs([1, 14, 0, 30, 45, 61]), heads=6, block_size=16, window=16,
                ratio=4 if csa else 16, topk=12 if csa else None, csa=csa, graph=True,
                max_seq_len=100, seed=3)  # fmt: skip
    assert b.attn.seq_lens_cpu is None
    out = b.run()
    b.check(out)
    assert not out[2].any()


def test_eager_all_decode_without_padding_uses_the_whole_batch() -> None:
    b = V4Batch(decode_seqs([4, 17, 26]), heads=4, dim=64, block_size=8, window=8, ratio=8)
    b.check(b.run(num_splits=2, block_h=16, block_n=16))


def test_poison_is_seen() -> None:
    # The poison catches reads: the reference, which gathers the entries
    # max_seq_len allows and masks those not yet complete, turns NaN on the
    # poisoned caches; the kernel, which reads only what each row may see,
    # does not.
    b = V4Batch(decode_seqs([9, 30, 47]), heads=4, block_size=8, window=8, ratio=8)
    raw = ref.sparse_attention(b.q, b.kv_cache, b.attn, **b.kwargs())
    assert raw.isnan().any()
    b.check(b.run(num_splits=2, block_h=16, block_n=16))


def test_bf16() -> None:
    b = V4Batch(decode_seqs(LENS), heads=12, dim=64, block_size=8, window=16, ratio=4, topk=10,
                csa=True, dtype=torch.bfloat16, seed=5)  # fmt: skip
    b.check(b.run(num_splits=2, block_h=16, block_n=16))


def test_workspace() -> None:
    b = V4Batch(decode_seqs([6, 27, 40]), heads=5, block_size=8, window=8, ratio=8, seed=2)
    ws = Workspace(DEVICE)
    out_ws = b.run(workspace=ws, num_splits=3, block_h=16, block_n=16)
    assert ws.stats.num_growths == 1  # the partials came from the arena
    assert torch.equal(out_ws, b.run(num_splits=3, block_h=16, block_n=16))
    b.check(out_ws)
    b.check(tri.sparse_attention(b.q, b.kv_cache, b.attn, **b.kwargs(), workspace=ws))


def test_same_signature_as_reference() -> None:
    import inspect

    assert inspect.signature(tri.sparse_attention) == inspect.signature(ref.sparse_attention)


def test_address_differences_are_int64_arguments() -> None:
    """entry_offset and table_delta are differences of two buffers'
    addresses, which fit int32 or not by where the allocator put them:
    declared int64, every distance runs the one variant that startup's dry
    run compiled against profile's one-block caches."""
    from triton.runtime.jit import JITFunction

    from tinyengine.kernels.sparse_attention import gluon, split

    kernels = [split._sparse_split_kernel]
    if gluon.HAVE_GLUON:
        kernels.append(gluon._sparse_split_gluon)
    for kernel in kernels:
        # The argument types Triton reads off the function (the interpreter's
        # wrapper keeps the function as .fn, like a JITFunction).
        params = JITFunction(kernel.fn).params
        types = {p.name: p.annotation_type for p in params}
        assert types["entry_offset"] == types["table_delta"] == "i64", kernel


def test_split_choice() -> None:
    # V4-Flash decode (64 heads: one head block; CSA 128 + 512 keys = 10
    # tiles of 64, HCA at 4k 128 + 32 keys). The counts asserted are the
    # fastest measured on an H100 (bench_v4_attention.py --splits, where
    # the choice of the old fill-every-slot rule lost up to 5.5 us).
    cfg = tri.sparse_config
    assert cfg(1, 64, 512, 640, 132, 2)[:5] == (64, 64, 8, 2, 10)
    csa = {8: 10, 32: 3, 48: 2, 64: 1, 96: 1, 128: 1}
    assert {rows: cfg(rows, 64, 512, 640, 132, 2).num_splits for rows in csa} == csa
    hca = {32: 1, 48: 1, 64: 1, 128: 1}
    assert {rows: cfg(rows, 64, 512, 160, 132, 2).num_splits for rows in hca} == hca
    assert cfg(8, 64, 512, 160, 132, 2).num_splits == 3  # every tile (4 measured best)
    assert cfg(8, 64, 512, 128 + 65536 // 128, 132, 2).num_splits == 10
    assert cfg(1, 64, 512, 640, 132, 4)[:2] == (32, 32)  # fp32 tiles
    # 4-warp programs: two fit an SM, so twice the programs fill it.
    assert tri.num_splits_for(16, 64, 32, 640, 32, 132, num_warps=4) == 6
    assert tri.num_splits_for(16, 64, 32, 640, 32, 132, num_warps=8) == 3
    for rows in range(1, 300):
        for keys in (1, 100, 640, 5000):
            s = cfg(rows, 64, 512, keys, 132, 2).num_splits
            assert 1 <= s <= tri.MAX_SPLITS and (s == 1 or 4 * rows * s <= 3 * 132)


# ----------------------------------------------------------------------------- GPU

FLASH = dict(heads=64, dim=512, block_size=64, window=128, dtype=torch.bfloat16)


def flash_batch(lens: list[int], csa: bool, **kw) -> V4Batch:
    return V4Batch(decode_seqs(lens), ratio=4 if csa else 128, topk=512 if csa else None,
                   csa=csa, **FLASH, **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("csa", [False, True])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_gpu_v4_flash_shapes(batch: int, csa: bool) -> None:
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 6000, (batch,), generator=g).tolist()
    lens[0] = 4096 if batch > 1 else lens[0]
    b = flash_batch(lens, csa, graph=batch > 1, max_seq_len=8192, seed=batch)
    b.check(b.run(workspace=Workspace(DEVICE)))


@pytest.mark.gpu
def test_gpu_mixed_batch_and_fp32() -> None:
    seqs = [(300, 1), (700, 200), (129, 1), (1000, 1)]
    b = V4Batch(seqs, ratio=4, topk=512, csa=True, **FLASH, seed=1)
    b.check(b.run())
    b = V4Batch(seqs, ratio=128, **{**FLASH, "dtype": torch.float32}, two_groups=False, seed=2)
    b.check(b.run())


@pytest.mark.gpu
@pytest.mark.parametrize("csa", [False, True])
def test_gpu_cuda_graph_replay(csa: bool) -> None:
    # Capture at one set of lengths, replay at others (the graph must read
    # lengths, tables and picks from the device, sizes from host ints only).
    lens = [5, 1000, 3000, 4097, 200, 64, 129, 2500]
    b = flash_batch(lens, csa, graph=True, max_seq_len=8192, seed=4)
    ws = Workspace(DEVICE)
    args = (b.q, b.kv_cache, b.attn)
    eager = tri.sparse_attention(*args, **b.kwargs(), workspace=ws)  # sizes the arena
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.sparse_attention(*args, **b.kwargs(), workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tri.sparse_attention(*args, **b.kwargs(), workspace=ws)
    graph.replay()
    assert torch.equal(captured, eager)
    # New step contents in the same buffers: shorter lengths, new picks
    # (the poison made finite: the new windows reach slots the first did not).
    b.kv_cache.nan_to_num_(nan=0.5)
    b.entry_cache.nan_to_num_(nan=0.5)
    b.attn.seq_lens.copy_(b.attn.seq_lens // 2 + 1)
    if csa:
        b.topk.copy_(torch.where(b.topk >= 0, b.topk // 2, -1))
    b.q.copy_(torch.randn_like(b.q))
    graph.replay()
    assert torch.equal(captured, tri.sparse_attention(*args, **b.kwargs(), workspace=ws))


@pytest.mark.gpu
@pytest.mark.parametrize("csa", [False, True])
def test_gpu_gluon_kernel(csa: bool) -> None:
    # On a Hopper GPU the V4-Flash tile runs the Gluon split kernel
    # (kernels/sparse_attention/gluon.py), which takes a CSA row's picks
    # where they are instead of compacting them: dead picks scattered, a
    # whole dead tile, splits with no live key, padding rows, prefill rows.
    import tinyengine.kernels.sparse_attention.gluon as sparse_gluon

    seqs = [(5, 1), (1000, 1), (3000, 1), (4097, 1), (700, 200), (129, 1), (2500, 1)]
    b = V4Batch(seqs, ratio=4 if csa else 128, topk=512 if csa else None, csa=csa, pad_rows=3,
                **FLASH, seed=7)  # fmt: skip
    if csa:
        b.topk[2, 64:192] = -1  # two whole tiles of dead picks mid-row
        b.topk[3, 256:] = -1  # the row's last splits see only dead keys
    aligned = b.kv_cache.stride(1) % 16 == 0
    assert sparse_gluon.supports(b.q, b.kv_cache, b.entry_cache, 64, 64, aligned)
    expected = b.reference()
    for splits in (1, 2, 5, 10):
        out = b.run(num_splits=splits)
        b.check(out, expected)
        triton_out = b.run(num_splits=splits, gluon=False)
        torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=2e-2)
