"""The MLA decode sweep's tile grid (benchmarks/sweep_mla.py): the tile
configurations it times (Gluon, Triton on TMA pages, pointer gathers; their
cache block sizes), the override kwargs each passes to launch_mla_decode, how
a tile prints, and the split rule the kernel shipped with before the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class Tile:
    name: str
    block_h: int
    block_n: int
    warps: int
    stages: int
    tma: bool  # whole tiles through TMA descriptors (paged_tma)
    lazy: bool  # LAZY_RESCALE
    block_size: int  # the cache's block size the tile runs on
    old_splits: bool = False  # split count from the previous heuristic
    gluon: bool = False  # the Hopper Gluon split kernel (tinyengine/kernels/mla/gluon.py)


# Naming: g = the Gluon kernel (TMA pages; its only shape), t = the Triton
# kernel on TMA pages (64-token cache blocks, the engine's default for
# DeepSeek on CUDA), c = pointer gathers (16-token blocks unless b64);
# <block_h>x<block_n>, then s<stages> / w<warps> when not the usual, l = lazy
# rescale (TMA tiles), e = eager (pointer tiles). The first entry of each list
# is what mla_config picks today on 64-token blocks.
TILES_128 = [
    Tile("g64x64", 64, 64, 8, 2, True, False, 64, gluon=True),
    Tile("t64x64", 64, 64, 8, 2, True, False, 64),
    Tile("t64x64l", 64, 64, 8, 2, True, True, 64),
    Tile("t64x32", 64, 32, 8, 2, True, False, 64),
    Tile("t64x32s3", 64, 32, 8, 3, True, False, 64),
    Tile("c64x64", 64, 64, 8, 2, False, True, 16),  # the default on 16-token blocks
    Tile("c64x64e", 64, 64, 8, 2, False, False, 16),
    Tile("c64x32", 64, 32, 8, 2, False, True, 16),
    Tile("c32x32w8", 32, 32, 8, 2, False, True, 16),
    Tile("old", 16, 32, 4, 2, False, False, 16, old_splits=True),
]
TILES_16 = [
    Tile("t16x32s3", 16, 32, 4, 3, True, False, 64),
    Tile("c16x32b64", 16, 32, 4, 2, False, True, 64),
    Tile("c16x32", 16, 32, 4, 2, False, True, 16),
    Tile("t16x32s3l", 16, 32, 4, 3, True, True, 64),
    Tile("t16x32l", 16, 32, 4, 2, True, True, 64),
    Tile("t16x64l", 16, 64, 4, 2, True, True, 64),
    Tile("c16x64", 16, 64, 4, 2, False, True, 16),
    Tile("old", 16, 32, 4, 2, False, False, 16, old_splits=True),
]
CONFIG_BLOCK_SIZE = 64  # the block size mla_config is asked about (engine default)


def tiles_for(heads: int) -> list[Tile]:
    return TILES_128 if heads >= 64 else TILES_16


def old_num_splits(batch: int, heads: int, ctx: int, sms: int) -> int:
    """The split rule this kernel shipped with before the sweep (16-head blocks)."""
    programs = batch * triton.cdiv(heads, 16)
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, programs), max(1, ctx // 256), 64))


def run_kwargs(tile: Tile, splits: int) -> dict:
    return dict(
        num_splits=splits, block_h=tile.block_h, block_n=tile.block_n, num_warps=tile.warps,
        num_stages=tile.stages, paged_tma=tile.tma, lazy_rescale=tile.lazy, gluon=tile.gluon,
    )  # fmt: skip


def describe(tile: Tile) -> str:
    loads = f"{'gluon' if tile.gluon else 'tma' if tile.tma else 'ptr'} bs{tile.block_size:<2}"
    rescale = "lazy " if tile.lazy else "eager"
    shape = f"bh{tile.block_h:<3}bn{tile.block_n:<3}w{tile.warps} s{tile.stages}"
    return f"{tile.name:<9} {shape} {loads} {rescale}"
