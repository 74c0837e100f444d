"""Triton compressor (tinyengine/kernels/compressor/triton.py) vs the torch
reference (tinyengine/kernels/compressor/reference.py).

CPU runs go through the Triton interpreter, so shapes stay small (D 16-64,
rope_dim 8-16, block sizes 4-16, contexts up to ~70 tokens). Both paged
groups are laid out as the engine does: the sliding group (state rows,
AttentionMetadata.block_tables / slot_mapping) holds only the blocks that
some read or this step's write touches, every other table entry pointing at
its dummy block; the full-history group (entries, entry_block_tables) has
every block, in a different random permutation. Every state value no window
of the step may read (the half of an overlapping row that is not used, rows
outside the windows, the dummy block, spare blocks) is NaN, so a stray read
shows up as a NaN in a written entry. Entries the step writes are compared
with the reference's everywhere but the entry dummy block (the reference
writes decode rows that complete no window there; the kernel skips them).

The GPU tests run V4-Flash shapes (D 512 ratio 4 with overlap, D 512 ratio
128, D 128 ratio 4 with overlap; bf16 entries; 64 rows) against the
reference, and a CUDA-graph capture and replay against the eager launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import tinyengine.kernels.compressor.reference as ref
import tinyengine.kernels.compressor.triton as tri
from tinyengine.kernels.compressor.reference import entry_slots
from tinyengine.models.context import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Case:
    state: torch.Tensor  # the state cache before the step's rows are written
    entries: torch.Tensor  # the entry cache before the step (finite)
    kv: torch.Tensor  # [T, C] the step's tokens' state
    gate: torch.Tensor
    attn: AttentionMetadata
    kwargs: dict
    written: torch.Tensor  # flat entry rows the step must write

    def run(self, op, *, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(state cache, entry cache) after `op` on copies of this case's.
        Not fused: the step's rows are written first (write_rows), then op is
        a compress_windows; fused: op is a write_and_compress."""
        state, entries = self.state.clone(), self.entries.clone()
        if fused:
            op(state, entries, self.kv, self.gate, self.attn, **self.kwargs)
        else:
            rows = torch.cat([self.kv, self.gate], dim=-1)
            ref.write_rows(state, rows, self.attn.slot_mapping)
            op(state, entries, self.attn, **self.kwargs)
        return state, entries


def make_case(
    seqs: list[tuple[int, int]], *, dim: int = 32, rope_dim: int = 8, ratio: int = 4,
    overlap: bool = True, block_size: int = 8, entry_table: bool = True, graph: bool = False,
    padding: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = DEVICE,
) -> Case:  # fmt: skip
    """seqs: (context length after the step, tokens this step) each; `padding`
    more one-token rows of a graph-shaped step, paged in the dummy blocks."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * dim if overlap else dim
    rows_per_block = -(-block_size // ratio)
    nbs = [-(-s // block_size) for s, _ in seqs]
    # What each sequence reads: (position, column ranges of its state row).
    reads: list[dict[int, list[tuple[int, int]]]] = []
    for s, q in seqs:
        need: dict[int, list[tuple[int, int]]] = {}
        for w in range((s - q) // ratio, s // ratio):
            cb = [(0, 2 * width)] if not overlap else [(dim, 2 * dim), (3 * dim, 4 * dim)]
            for p in range(w * ratio, (w + 1) * ratio):
                need.setdefault(p, []).extend(cb)
            # The previous window through its Ca half. Window 0 has none; the
            # reference gathers position 0 in its place (weighing 0, so it
            # must be finite), the kernel nothing.
            ca = [(0, dim), (2 * dim, 3 * dim)]
            for p in range((w - 1) * ratio, w * ratio) if overlap else ():
                need.setdefault(max(p, 0), []).extend(ca)
        reads.append(need)
    step_blocks = [{p // block_size for p in range(s - q, s)} for s, q in seqs]
    used = [
        set(range(nb)) if not entry_table else step | {p // block_size for p in need}
        for nb, step, need in zip(nbs, step_blocks, reads, strict=True)
    ]
    num_state = sum(len(u) for u in used) + 2  # two spare blocks, then the dummy
    num_entry = num_state if not entry_table else sum(nbs) + 3
    width_t = max(nbs) + 1
    state_table = torch.full((len(seqs) + padding, width_t), num_state, dtype=torch.int32)
    entry_tab = torch.full((len(seqs) + padding, width_t), num_entry, dtype=torch.int32)
    state_perm = torch.randperm(num_state, generator=g).int().tolist()
    entry_perm = torch.randperm(num_entry, generator=g).int().tolist()
    state = torch.full((num_state + 1, block_size, 2 * width), float("nan"))
    flat = state.view(-1, 2 * width)
    kv_rows, slots, written = [], [], []
    for i, ((s, q), nb, u, need) in enumerate(zip(seqs, nbs, used, reads, strict=True)):
        for j in sorted(u):
            state_table[i, j] = state_perm.pop()
        if entry_table:
            entry_tab[i, :nb] = torch.tensor([entry_perm.pop() for _ in range(nb)])
        else:
            entry_tab[i] = state_table[i]
        for p, cols in need.items():
            slot = int(state_table[i, p // block_size]) * block_size + p % block_size
            for lo, hi in cols:
                flat[slot, lo:hi] = torch.randn(hi - lo, generator=g)
        for p in range(s - q, s):
            slots.append(int(state_table[i, p // block_size]) * block_size + p % block_size)
            kv_rows.append(torch.randn(2 * width, generator=g))
        windows = torch.arange((s - q) // ratio, s // ratio)
        written.append(entry_slots(entry_tab[i], windows, ratio, block_size, rows_per_block))
    slots += [num_state * block_size] * padding
    kv_rows += [torch.randn(2 * width, generator=g) for _ in range(padding)]
    seq_lens = [s for s, _ in seqs] + [1] * padding
    starts = [0]
    for _, q in seqs + [(1, 1)] * padding:
        starts.append(starts[-1] + q)
    step = torch.stack(kv_rows)
    entries = torch.randn(num_entry + 1, rows_per_block, dim, generator=g)
    positions = torch.arange(max(seq_lens) + ratio, dtype=torch.float32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope_dim, 2) / rope_dim)
    angles = positions[:, None] * inv_freq
    kwargs = dict(
        ratio=ratio, overlap=overlap, eps=1e-6,
        position_bias=torch.randn(ratio, width, generator=g).to(device),
        norm_weight=(1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(device),
        cos_sin=torch.cat([angles.cos(), angles.sin()], dim=-1).to(device),
    )  # fmt: skip
    tables = state_table.to(device)
    attn = AttentionMetadata(
        num_tokens=starts[-1], num_seqs=len(seq_lens), max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables, slot_mapping=torch.tensor(slots, device=device),
        query_start_loc_cpu=None if graph else starts, seq_lens_cpu=None if graph else seq_lens,
        entry_block_tables=entry_tab.to(device) if entry_table else None,
    )  # fmt: skip
    kv, gate = step.to(device).split(width, dim=-1)
    written = torch.cat(written).to(device)
    return Case(state.to(device), entries.to(dtype).to(device), kv, gate, attn, kwargs, written)


def check(case: Case, *, fused: bool = False, op=None) -> None:
    """The Triton op's caches (or `op`'s, a compress_windows) against the
    reference's (entries but the dummy block; with fused, the state cache
    too, NaN where it was)."""
    ops = (tri.write_and_compress, ref.write_and_compress) if fused else (
        op or tri.compress_windows, ref.compress_windows)  # fmt: skip
    state, entries = case.run(ops[0], fused=fused)
    want_state, want_entries = case.run(ops[1], fused=fused)
    assert case.written.numel(), "the case completes no window"
    flat = entries.view(-1, entries.shape[-1])
    assert torch.isfinite(entries[:-1]).all()
    before = case.entries.view(-1, entries.shape[-1])[case.written]
    assert (flat[case.written] != before).any(-1).all()  # every entry was written
    # fp32: summation order only; bf16: one rounding step apart at most.
    tol = 2e-5 if entries.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(entries[:-1], want_entries[:-1], atol=tol, rtol=tol)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0, equal_nan=True)


# Decode rows: window 0 (p < ratio: no predecessor), rows completing a window
# across a block boundary, rows completing none, and contexts past 8 blocks.
DECODE = [(4, 1), (2, 1), (8, 1), (12, 1), (13, 1), (24, 1), (31, 1), (68, 1)]


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("entry_table", [True, False])
def test_csa_decode_rows(block_size, entry_table):
    check(make_case(DECODE, block_size=block_size, entry_table=entry_table, seed=block_size))


@pytest.mark.parametrize(("ratio", "block_size"), [(8, 4), (8, 16), (16, 8), (16, 16)])
def test_hca_decode_rows(ratio, block_size):
    seqs = [(8, 1), (16, 1), (5, 1), (32, 1), (48, 1), (64, 1), (63, 1)]
    case = make_case(seqs, ratio=ratio, overlap=False, block_size=block_size, dim=64,
                     rope_dim=16, seed=ratio + block_size)  # fmt: skip
    check(case)
    entries = case.run(tri.compress_windows, fused=False)[1]
    assert torch.equal(entries[-1], case.entries[-1])  # rows with no window write nothing


@pytest.mark.parametrize(("ratio", "overlap", "block_j"), [(4, True, 2), (4, True, 4),
                                                           (16, False, 4)])  # fmt: skip
def test_window_in_several_tiles(ratio, overlap, block_j):
    """Fewer slots per tile than the window: the softmax runs online across
    tiles, one of them wholly masked for window 0 with overlap."""
    seqs = [(ratio, 1), (2 * ratio, 1), (5 * ratio, 1), (3, 1)]
    case = make_case(seqs, ratio=ratio, overlap=overlap, block_size=8, entry_table=False,
                     seed=block_j)  # fmt: skip

    def tiled(state, entries, attn, **kwargs):
        tables = attn.block_tables
        tri.compress_decode(state, entries, attn.seq_lens, tables, tables, block_j=block_j,
                            **kwargs)  # fmt: skip

    check(case, op=tiled)


@pytest.mark.parametrize("entry_table", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batch(entry_table, overlap):
    """Decode rows between longer chunks (a prefill from 0, chunks after a
    cached prefix): the kernel does the decode rows, the reference's loop
    the rest."""
    seqs = [(12, 1), (9, 9), (40, 7), (3, 1), (16, 1), (26, 10)]
    ratio = 4 if overlap else 8
    case = make_case(seqs, ratio=ratio, overlap=overlap, entry_table=entry_table, seed=7)
    check(case)
    check(case, fused=True)


@pytest.mark.parametrize("entry_table", [True, False])
def test_graph_shaped_step(entry_table):
    """No host lengths and padding rows in the dummy blocks, as a padded
    CUDA-graph step has; fused, the state rows are written in the kernel."""
    case = make_case(DECODE, graph=True, padding=3, entry_table=entry_table, seed=11)
    check(case)
    check(case, fused=True)


def test_eager_decode_step_fused():
    case = make_case(DECODE, dim=16, rope_dim=8, block_size=4, seed=12)
    check(case, fused=True)
    case = make_case(DECODE, ratio=8, overlap=False, seed=13)
    check(case, fused=True)


def test_bf16_entries():
    check(make_case(DECODE, dim=64, rope_dim=16, dtype=torch.bfloat16, seed=14))
    check(make_case(DECODE, dim=64, rope_dim=16, dtype=torch.bfloat16, graph=True, seed=15),
          fused=True)  # fmt: skip


def test_rope_covering_every_channel():
    check(make_case(DECODE, dim=16, rope_dim=16, seed=16))


def test_rejects_mismatched_state():
    case = make_case([(4, 1)])
    bad = dict(case.kwargs, overlap=False)
    with pytest.raises(ValueError, match="state rows"):
        tri.compress_windows(case.state, case.entries.clone(), case.attn, **bad)


# ----------------------------------------------------------------------------- GPU: V4-Flash

V4_SHAPES = [(512, 4, True), (512, 128, False), (128, 4, True)]  # entries, indexer keys


def _v4_case(dim: int, ratio: int, overlap: bool, **kw) -> Case:
    """64 rows at contexts up to ~1.5k, a third of them completing a window."""
    g = torch.Generator().manual_seed(dim + ratio)
    contexts = torch.randint(1, 1536 // ratio, (64,), generator=g) * ratio
    contexts -= (torch.arange(64) % 3 != 0).long() * torch.randint(1, ratio, (64,), generator=g)
    seqs = [(max(int(c), 1), 1) for c in contexts]
    return make_case(seqs, dim=dim, ratio=ratio, overlap=overlap, rope_dim=64, block_size=64,
                     dtype=torch.bfloat16, device="cuda", **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "ratio", "overlap"), V4_SHAPES)
@pytest.mark.parametrize("graph", [False, True])
def test_v4_flash_shapes_match_reference_gpu(dim, ratio, overlap, graph):
    case = _v4_case(dim, ratio, overlap, graph=graph)
    check(case)
    check(case, fused=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "ratio", "overlap"), V4_SHAPES)
def test_cuda_graph_replay_equals_eager_gpu(dim, ratio, overlap):
    case = _v4_case(dim, ratio, overlap, graph=True)
    eager_state, eager_entries = case.run(tri.write_and_compress, fused=True)  # also compiles
    state, entries = case.state.clone(), case.entries.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.write_and_compress(state, entries, case.kv, case.gate, case.attn, **case.kwargs)
    state.copy_(case.state)
    entries.copy_(case.entries)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(state, eager_state, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(entries, eager_entries)
    assert (entries.view(-1, dim)[case.written] != case.entries.view(-1, dim)[case.written]).any()
