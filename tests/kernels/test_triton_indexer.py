"""Triton lightning indexer (tinyengine/kernels/indexer/triton.py) vs the torch
reference (tinyengine/kernels/indexer/reference.py) and dense scores written here.

CPU runs go through the Triton interpreter, so shapes stay tiny (4-8 heads,
Di 16-32, contexts up to ~200 tokens). Inputs are small integers and the
scale a power of two, so every fp32 sum is exact whatever its order: picks
must equal the reference's exactly, ties included. Compressed entries sit in
randomly permuted blocks; every slot no visible entry owns (spare rows,
entries not complete yet, table padding) holds NaN, so a read outside what a
row may see shows up. With a separate entry table, block_tables points only
at the poisoned block: reading through it is caught too. Mixed steps
(decode rows, chunks after a cached prefix, whole prompts, padding rows) run
every token through the kernels as a row of its own, and must pick exactly
what the reference's per-sequence loop (choose_longer) picks
(test_triton_v4_prefill.py: row blocks, ties in chunks, long chunks on the GPU).

The top-k select (kernels/indexer/select.py) is checked on its own against torch.topk on packed
keys built to stress it (ties across the k-th place, scores equal but for
their last mantissa bits, +-0.0, -inf). The GPU tests run V4-Flash shapes
(64 heads, Di 128, bf16, top 512, contexts up to 64k) against the reference,
every benchmarked tile configuration, and a CUDA-graph replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

import tinyengine.kernels.indexer.reference as ref
import tinyengine.kernels.indexer.select as sel
import tinyengine.kernels.indexer.triton as tri
from tinyengine.kernels.compressor.reference import entry_slots
from tinyengine.kernels.workspace import Workspace
from tinyengine.models.context import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Batch:
    q: torch.Tensor
    weights: torch.Tensor
    cache: torch.Tensor
    attn: AttentionMetadata
    table: torch.Tensor  # the entry table, whichever field holds it
    kwargs: dict

    def run(self, op=tri.indexer_topk, **extra) -> torch.Tensor:
        return op(self.q, self.weights, self.cache, self.attn, **self.kwargs, **extra)


def make_batch(
    seqs: list[tuple[int, int]], *, heads: int = 4, dim: int = 16, block_size: int = 8,
    ratio: int = 4, topk: int = 8, entry_table: bool = True, graph: bool = False,
    max_seq_len: int | None = None, dtype: torch.dtype = torch.float32, integer: bool = True,
    zero_q: bool = False, same_keys: bool = False, pad_rows: int = 0, seed: int = 0,
    device: str = DEVICE,
) -> Batch:  # fmt: skip
    """seqs: (context length after the step, query rows this step) each;
    pad_rows: rows after the last sequence's (padding of an eager step)."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-block_size // ratio) + 1
    blocks = [-(-s // block_size) for s, _ in seqs]
    max_len = max_seq_len or max(s for s, _ in seqs)
    num_blocks = sum(blocks) + 1
    poison = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=g).int()
    table = torch.full((len(seqs), -(-max_len // block_size) + 1), poison, dtype=torch.int32)
    cache = torch.full((num_blocks, rows, dim), float("nan"))
    flat = cache.view(-1, dim)
    shared = torch.randint(-3, 4, (dim,), generator=g).float()
    for i, ((s, _), nb) in enumerate(zip(seqs, blocks, strict=True)):
        table[i, :nb], perm = perm[:nb], perm[nb:]
        n = s // ratio
        if integer:
            keys = torch.randint(-3, 4, (n, dim), generator=g).float()
        else:
            keys = torch.randn(n, dim, generator=g)
        if same_keys:
            keys = shared.expand(n, -1)
        flat[entry_slots(table[i], torch.arange(n), ratio, block_size, rows)] = keys
    num_tokens = sum(t for _, t in seqs) + pad_rows
    if integer:
        q = torch.randint(-2, 3, (num_tokens, heads, dim), generator=g).float()
        weights = torch.randint(-2, 3, (num_tokens, heads), generator=g).float()
        scale = 0.25
    else:
        q = torch.randn(num_tokens, heads, dim, generator=g)
        weights = torch.randn(num_tokens, heads, generator=g) * heads**-0.5
        scale = dim**-0.5
    if zero_q:
        q.zero_()
    starts = [0]
    for _, t in seqs:
        starts.append(starts[-1] + t)
    table = table.to(device)
    attn = AttentionMetadata(
        num_tokens=num_tokens, num_seqs=len(seqs), max_query_len=max(t for _, t in seqs),
        max_seq_len=max_len,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=torch.full_like(table, poison) if entry_table else table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        query_start_loc_cpu=None if graph else starts,
        seq_lens_cpu=None if graph else [s for s, _ in seqs],
        entry_block_tables=table if entry_table else None,
    )  # fmt: skip
    kwargs = dict(ratio=ratio, topk=topk, scale=scale, block_size=block_size)
    return Batch(q.to(dtype).to(device), weights.to(device), cache.to(dtype).to(device), attn,
                 table, kwargs)  # fmt: skip


def dense_scores(
    b: Batch, rows: list[int], seq_lens: list[int], num_entries: int,
    seqs: list[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """fp32 [len(rows), num_entries] scores of query rows `rows`, each a
    decode row of length seq_lens[j] reading table row seqs[j] (default j),
    in fp64 (exact for integer inputs), -inf where the row cannot see the entry."""
    r, bs = b.kwargs["ratio"], b.kwargs["block_size"]
    flat = b.cache.double().cpu().view(-1, b.cache.shape[-1])
    out = torch.full((len(rows), num_entries), float("-inf"), dtype=torch.float64)
    seqs = list(range(len(rows))) if seqs is None else seqs
    for j, (row, s) in enumerate(zip(rows, seq_lens, strict=True)):
        n = min(s // r, num_entries)
        table = b.table[seqs[j]].cpu()
        keys = flat[entry_slots(table, torch.arange(n), r, bs, b.cache.shape[1])]
        qk = torch.relu(b.q[row].double().cpu() @ keys.T)  # [H, n]
        out[j, :n] = b.kwargs["scale"] * (b.weights[row].double().cpu() @ qk)
    return out.float()


# ----------------------------------------------------------------------------- packed keys

SPECIAL = [1.0, -1.0, 0.0, -0.0, float("-inf"), 2.0, -2.0, 0.0, 1e-30, -1e-30, 1e-45, -1e-45,
           3.4e38, -3.4e38, float("inf"), -0.0, 1.0, float("-inf"), -2.0]  # fmt: skip


def test_pack_scores_orders_like_a_stable_sort():
    scores = torch.tensor([SPECIAL])
    keys = ref.pack_scores(scores)
    assert keys.unique().numel() == len(SPECIAL)  # distinct: topk has one answer
    picked = ref.unpack_picks(keys.topk(len(SPECIAL), dim=-1).values)[0]
    values, order = scores[0].sort(descending=True, stable=True)
    expected = torch.where(values == float("-inf"), -1, order)
    assert picked.tolist() == expected.tolist()
    # -0.0 and +0.0 tie (lower id first), and every -inf comes back as -1.
    zeros = [i for i in picked.tolist() if i >= 0 and SPECIAL[i] == 0.0]
    assert zeros == [2, 3, 7, 15]
    assert picked.tolist()[-2:] == [-1, -1]


@triton.jit
def _pack_test_kernel(scores_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + offs, mask=offs < N, other=0.0)
    tl.store(out_ptr + offs, tri._pack_keys(s, offs), mask=offs < N)


def test_kernel_packing_matches_torch():
    scores = torch.tensor(SPECIAL + [5.5, -7.25, 0.5], device=DEVICE)
    out = torch.empty(scores.shape, dtype=torch.int64, device=DEVICE)
    _pack_test_kernel[(1,)](scores, out, N=scores.numel(), BLOCK=32)
    assert torch.equal(out, ref.pack_scores(scores))


def _torch_picks(keys: torch.Tensor, topk: int) -> torch.Tensor:
    k = min(topk, keys.shape[1])
    picks = ref.unpack_picks(keys.topk(k, dim=1).values)
    return torch.cat([picks, picks.new_full((keys.shape[0], topk - k), -1)], dim=1)


def _select_rows(num_entries: int, seed: int) -> torch.Tensor:
    """fp32 [7, E] scores that exercise the radix select: ties across the
    k-th place, scores that differ only in their last mantissa bits (every
    pass runs), signs, zeros of both signs, -inf, one all -inf row, one
    all-equal row."""
    g = torch.Generator().manual_seed(seed)
    e = num_entries
    rows = [
        torch.randint(-5, 6, (e,), generator=g).float(),
        1 + torch.randint(0, 4, (e,), generator=g).float() * 2**-20,
        -(1 + torch.randint(0, 3, (e,), generator=g).float() * 2**-21),
        torch.randn(e, generator=g),
        torch.full((e,), float("-inf")),
        torch.full((e,), 0.75),
        torch.randint(-1, 2, (e,), generator=g).float() * 0.0,  # +0.0 and -0.0
    ]
    scores = torch.stack(rows)
    scores[0, torch.randperm(e, generator=g)[: e // 3]] = float("-inf")
    scores[3, : e // 2] = float("-inf")
    return scores


@pytest.mark.parametrize(
    ("num_entries", "topk", "chunk"),
    [(300, 16, 64), (50, 64, 16), (64, 64, 16), (65, 64, 32), (1000, 128, 256), (700, 100, 128),
     (2, 8, 16), (1, 1, 16)],
)  # fmt: skip
@pytest.mark.parametrize("digit", [5, 8])
def test_select_matches_torch_topk_on_packed_keys(num_entries, topk, chunk, digit):
    """Chunks smaller than the rows: two or three levels of the select tree;
    a digit that does not divide 32 (a short last pass) and one that does."""
    keys = ref.pack_scores(_select_rows(num_entries, seed=num_entries)).to(DEVICE)
    out = sel.select_topk(keys, topk, chunk=chunk, digit=digit)
    assert torch.equal(out.cpu(), _torch_picks(keys.cpu(), topk))


# ----------------------------------------------------------------------------- kernel vs dense

# (block_e, tiles_per_program, block_size, heads, dim)
PATHS = [
    (16, 1, 4, 4, 16),  # one 16-entry tile per program, 2-row blocks
    (16, 2, 8, 8, 32),  # two tiles a program: the loop and the -inf fill both run
    (32, 1, 16, 6, 24),  # heads and Di not powers of two: padded, masked
    (16, None, 16, 4, 16),  # the default chunking
    (64, 3, 8, 4, 16),  # one chunk wider than the row: all in one program
]


@pytest.mark.parametrize(("block_e", "tiles", "block_size", "heads", "dim"), PATHS)
def test_score_entries_match_dense_scores(block_e, tiles, block_size, heads, dim):
    seqs = [(200, 1), (3, 1), (57, 1), (130, 1), (4, 1)]
    b = make_batch(seqs, heads=heads, dim=dim, block_size=block_size, max_seq_len=210)
    e = 210 // 4
    keys = tri.score_entries(
        b.q, b.weights, b.cache, b.attn.seq_lens, b.table, ratio=4, scale=0.25,
        block_size=block_size, num_entries=e, block_e=block_e, tiles_per_program=tiles,
    )  # fmt: skip
    dense = dense_scores(b, list(range(len(seqs))), [s for s, _ in seqs], e)
    assert torch.equal(keys.cpu(), ref.pack_scores(dense))


# ----------------------------------------------------------------------------- op vs reference


@pytest.mark.parametrize("entry_table", [True, False])
@pytest.mark.parametrize(
    ("block_size", "heads", "dim", "topk", "dtype"),
    [(4, 4, 16, 4, torch.float32), (8, 8, 32, 16, torch.float32), (16, 4, 16, 8, torch.bfloat16)],
)
def test_decode_rows_match_reference(entry_table, block_size, heads, dim, topk, dtype):
    seqs = [(97, 1), (2, 1), (160, 1), (33, 1), (8, 1), (199, 1)]
    b = make_batch(seqs, heads=heads, dim=dim, block_size=block_size, topk=topk,
                   entry_table=entry_table, dtype=dtype, seed=block_size)  # fmt: skip
    out = b.run()
    assert out.dtype == torch.long and out.shape == (len(seqs), topk)
    assert torch.equal(out, b.run(ref.indexer_topk))
    assert (out[1] == -1).all()  # 2 tokens: no window complete yet
    assert (out[4, :2] >= 0).all() and (out[4, 2:] == -1).all()  # 8 tokens: 2 entries


@pytest.mark.parametrize("entry_table", [True, False])
def test_graph_shaped_step_matches_reference(entry_table):
    """No host lengths (every row a decode row) and a max_seq_len above every
    row's, as a padded CUDA-graph step has."""
    seqs = [(45, 1), (1, 1), (120, 1), (77, 1)]
    b = make_batch(seqs, graph=True, max_seq_len=180, entry_table=entry_table, topk=12,
                   block_size=16, seed=3)  # fmt: skip
    ws = Workspace(DEVICE)
    out = b.run(workspace=ws)
    assert ws.stats.num_growths == 1  # the keys came from the arena
    assert torch.equal(out, b.run(ref.indexer_topk))
    assert (out[1] == -1).all()


# Decode rows between longer chunks: chunks after a cached prefix that
# start and end mid-block and cross windows, whole prompts, a chunk whose
# first rows see no entry yet.
MIXED = [(61, 1), (40, 9), (3, 1), (20, 20), (150, 1), (90, 2), (70, 33)]


@pytest.mark.parametrize("entry_table", [True, False])
@pytest.mark.parametrize(("block_size", "dtype"), [(8, torch.float32), (4, torch.bfloat16)])
def test_mixed_batch_matches_reference(entry_table, block_size, dtype):
    """Every row through the kernel, padding rows -1, exactly the reference's
    per-sequence picks (choose_longer) on integer inputs."""
    b = make_batch(MIXED, entry_table=entry_table, topk=10, block_size=block_size, dtype=dtype,
                   pad_rows=3, seed=5)  # fmt: skip
    ws = Workspace(DEVICE)
    out = b.run(workspace=ws)
    assert ws.stats.num_growths == 1  # the keys came from the arena
    assert out.shape == (b.attn.num_tokens, 10)
    assert torch.equal(out, b.run(ref.indexer_topk))
    assert (out[10] == -1).all()  # the 3-token sequence's row
    assert (out[11:14] == -1).all()  # positions 0..2 of the 20-token prefill
    assert (out[14:31, 0] >= 0).all()
    assert (out[-3:] == -1).all()  # padding


def test_rows_before_any_window():
    b = make_batch([(3, 1), (1, 1), (2, 1)], topk=4)  # max_seq_len < ratio: no entries at all
    out = b.run()
    assert out.shape == (3, 4) and (out == -1).all()
    assert torch.equal(out, b.run(ref.indexer_topk))


@pytest.mark.parametrize("graph", [False, True])
def test_ties_go_to_the_lower_entry_id(graph):
    """Zero queries: every ReLU is 0, every score of a row a zero. Equal keys:
    every score of a row the same value. Either way the first ids win."""
    seqs = [(150, 1), (30, 1), (5, 1)]
    expected = [list(range(16)), list(range(7)) + [-1] * 9, [0] + [-1] * 15]
    for case in (dict(zero_q=True), dict(same_keys=True)):
        b = make_batch(seqs, topk=16, graph=graph, **case)
        out = b.run()
        assert out.tolist() == expected, case
        assert torch.equal(out, b.run(ref.indexer_topk))


# ----------------------------------------------------------------------------- GPU: V4-Flash


def _v4_batch(contexts: list[int], **kw) -> Batch:
    return make_batch([(c, 1) for c in contexts], heads=64, dim=128, block_size=64, topk=512,
                      dtype=torch.bfloat16, **kw)  # fmt: skip


@pytest.mark.gpu
def test_v4_flash_shapes_pick_the_best_up_to_near_ties():
    contexts = [4096, 65536, 9000, 33001, 1999, 65535]
    b = _v4_batch(contexts, integer=False, graph=True, max_seq_len=65536, seed=1)
    out = b.run(workspace=Workspace(DEVICE)).cpu()
    dense = dense_scores(b, list(range(len(contexts))), contexts, 65536 // 4).double()
    for i, c in enumerate(contexts):
        n = min(512, c // 4)
        picks = out[i, :n]
        assert (out[i, n:] == -1).all() and (picks >= 0).all() and picks.unique().numel() == n
        assert (picks < c // 4).all()
        got = dense[i, picks]
        kth = dense[i].topk(n).values[-1]
        tol = 1e-3 * dense[i, : c // 4].abs().max()
        assert (got >= kth - tol).all(), (c, (kth - got).max())
        assert (got[1:] <= got[:-1] + tol).all()  # best first
    refs = b.run(ref.indexer_topk).cpu()
    agree = sum(len(set(out[i].tolist()) & set(refs[i].tolist())) for i in range(len(contexts)))
    assert agree >= 0.99 * refs.numel()


# Scoring tiles (block_e, num_warps, num_stages, tiles_per_program) that
# benchmarks/bench_v4_indexer.py --sweep times; the defaults are one of them.
SCORING_CONFIGS = [(64, 4, 2, 8), (64, 4, 3, 16), (64, 8, 4, 32), (128, 8, 3, 8), (128, 4, 2, 1)]
# (chunk, num_warps) of the select kernel, as the benchmark's SELECT_CONFIGS.
SELECT_CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


@pytest.mark.gpu
def test_v4_flash_shapes_exact_on_integers():
    b = _v4_batch([4096, 20000, 65536, 130], seed=2)
    out = b.run()
    assert torch.equal(out, b.run(ref.indexer_topk))
    for select in ("radix", "torch"):
        for block_e, warps, stages, tiles in SCORING_CONFIGS:
            picked = tri.rows_topk(
                b.q, b.weights, b.cache, b.attn.seq_lens, b.table, num_entries=65536 // 4,
                select=select, block_e=block_e, num_warps=warps, num_stages=stages,
                tiles_per_program=tiles, **b.kwargs,
            )  # fmt: skip
            assert torch.equal(out, picked), (select, block_e, warps, stages, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize(("chunk", "warps"), SELECT_CONFIGS)
def test_select_at_v4_sizes_matches_torch_topk(chunk, warps):
    scores = torch.cat([_select_rows(16384, seed=s) for s in range(3)])
    keys = ref.pack_scores(scores).cuda()
    out = sel.select_topk(keys, 512, chunk=chunk, num_warps=warps)
    assert torch.equal(out.cpu(), _torch_picks(keys.cpu(), 512))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    b = _v4_batch([4096, 12000, 9, 30001], integer=False, graph=True, max_seq_len=32768, seed=4)
    ws = Workspace(DEVICE)
    b.run(workspace=ws)  # compile, size the arena
    ws.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = b.run(workspace=ws)
    # Replay on other (shorter: their keys exist) contexts and queries.
    b.attn.seq_lens.copy_(torch.tensor([4000, 11000, 3, 30001], dtype=torch.int32))
    b.q.copy_(torch.randn_like(b.q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, b.run(workspace=ws))
    assert (captured[2] == -1).all() and (captured[3] >= 0).all()
