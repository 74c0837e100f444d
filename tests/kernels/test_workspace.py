"""The workspace arena: carving, alignment, aliasing, growth, stats, and the
lock (whose error must name the caller, the bytes asked and the bytes held).

All on CPU: the arena's bookkeeping is device-independent; the GPU hazard it
prevents is reproduced in tests/worker/test_gpu_graphs.py and, with the
recording graph backend, in tests/worker/test_graph_hazard.py.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyengine.kernels.workspace import ALIGNMENT, Workspace, WorkspaceLockedError

MIB = 1 << 20
DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _aligned_total(specs) -> int:
    """What get() asks of the arena: every view padded to ALIGNMENT."""
    total = 0
    for shape, dtype in specs:
        total = -(-(total + _nbytes(shape, dtype)) // ALIGNMENT) * ALIGNMENT
    return total


def _offsets(specs) -> list[int]:
    """Each view's offset in the carved region: the 256-aligned running sum."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total = -(-(total + _nbytes(shape, dtype)) // ALIGNMENT) * ALIGNMENT
    return offsets


def _check_views(ws: Workspace, specs, views) -> int:
    """Shapes, dtypes, aliasing, 256-aligned offsets, bounds, no overlap.
    Returns the address where the carved region starts."""
    assert len(views) == len(specs)
    alloc_start = ws.buffer.data_ptr()
    alloc_end = alloc_start + ws.buffer.numel()
    origins, spans = set(), []
    for (shape, dtype), offset, view in zip(specs, _offsets(specs), views, strict=True):
        assert view.shape == tuple(shape)
        assert view.dtype == dtype
        assert view.device == ws.buffer.device
        assert view.is_contiguous()
        if view.numel() == 0:
            continue  # an empty tensor has no address (data_ptr() is 0)
        # Every view aliases the one arena buffer...
        assert view.untyped_storage().data_ptr() == ws.buffer.untyped_storage().data_ptr()
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        # ...inside the allocation...
        assert alloc_start <= start and end <= alloc_end, (alloc_start, start, end, alloc_end)
        # ...at its 256-aligned offset from one common origin.
        origins.add(start - offset)
        spans.append((start, end))
    assert len(origins) <= 1, f"views disagree on where the region starts: {origins}"
    spans.sort()
    for (_, end_a), (start_b, _) in zip(spans, spans[1:], strict=False):
        assert end_a <= start_b, f"views overlap: {spans}"
    return origins.pop() if origins else alloc_start


def test_get_carves_aligned_non_overlapping_views_of_one_buffer():
    ws = Workspace("cpu")
    specs = [((3, 5), torch.float32), ((7,), torch.uint8), ((2, 3, 4), torch.int64),
             ((1,), torch.float16), ((129,), torch.bfloat16)]  # fmt: skip
    views = ws.get(*specs)
    origin = _check_views(ws, specs, views)
    # Offsets are exactly the 256-aligned running sum (no waste, no overlap).
    assert [v.data_ptr() - origin for v in views] == [0, 256, 512, 768, 1024]
    assert ws.stats.largest_request_bytes == _aligned_total(specs) == 1024 + 512


def test_views_alias_the_arena():
    ws = Workspace("cpu")
    a, b = ws.get(((4,), torch.int32), ((8,), torch.uint8))
    ws.buffer.zero_()
    a.fill_(0x01020304)
    b.fill_(7)
    # Writes through a view are visible in the arena, at the view's offset.
    at_a = a.data_ptr() - ws.buffer.data_ptr()
    assert ws.buffer[at_a : at_a + 16].view(torch.int32).tolist() == [0x01020304] * 4
    at_b = at_a + ALIGNMENT
    assert b.data_ptr() - ws.buffer.data_ptr() == at_b
    assert ws.buffer[at_b : at_b + 8].tolist() == [7] * 8
    # A later get within the held size hands out the same memory again.
    (c,) = ws.get(((4,), torch.int32))
    assert c.data_ptr() == a.data_ptr()
    assert c.tolist() == [0x01020304] * 4


def test_views_start_on_absolute_256_byte_boundaries():
    """tinyengine/kernels/workspace/arena.py promises every view "starts on a 256-byte
    boundary", not only at a 256-aligned offset: on CPU the buffer itself comes
    from an allocator that aligns to 64 bytes only, so this needs the arena to
    align its own base."""
    ws = Workspace("cpu")
    for n in (100, 5000, MIB, 3 * MIB):
        views = ws.get(((n,), torch.uint8), ((3, 5), torch.float32))
        for view in views:
            assert view.data_ptr() % ALIGNMENT == 0, (
                f"view at 0x{view.data_ptr():x} is {view.data_ptr() % ALIGNMENT} bytes past a "
                f"{ALIGNMENT}-byte boundary (arena base 0x{ws.buffer.data_ptr():x})"
            )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), min_size=0, max_size=3),
            st.sampled_from(DTYPES),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_get_property(specs):
    ws = Workspace("cpu")
    views = ws.get(*specs)
    _check_views(ws, specs, views)
    total = _aligned_total(specs)
    assert ws.stats.largest_request_bytes == total
    assert ws.size >= total
    assert ws.size % MIB == 0
    assert ws.stats.num_growths == (1 if total > 0 else 0)


def test_request_within_held_size_does_not_grow():
    ws = Workspace("cpu")
    ws.get(((1000,), torch.float32))
    size, ptr = ws.size, ws.buffer.data_ptr()
    assert ws.stats.num_growths == 1 and ws.stats.size_bytes == size
    for _ in range(3):
        ws.get(((10,), torch.float32), ((size // 2,), torch.uint8))
        ws.get(((size,), torch.uint8))  # exactly the held size
    assert ws.size == size
    assert ws.buffer.data_ptr() == ptr
    assert ws.stats.num_growths == 1
    assert ws.stats.largest_request_bytes == size


def test_growth_replaces_buffer_and_records_stage():
    ws = Workspace("cpu")
    assert ws.size == 0 and ws.stats.num_growths == 0 and ws.stats.size_bytes == 0

    ws.stage = "profile"
    (small,) = ws.get(((1000,), torch.uint8))
    first_ptr, first_size = ws.buffer.data_ptr(), ws.size
    assert first_size == MIB  # grown in whole MiB

    ws.stage = "warmup"
    (big,) = ws.get(((MIB + 1,), torch.uint8))
    assert ws.size == 2 * MIB
    assert ws.buffer.data_ptr() != first_ptr, "growth must replace the buffer"
    assert big.untyped_storage().data_ptr() == ws.buffer.untyped_storage().data_ptr()
    assert big.data_ptr() != small.data_ptr()
    # The old view still points at the old buffer (which is why the lock exists).
    assert small.untyped_storage().data_ptr() != ws.buffer.untyped_storage().data_ptr()

    ws.stage = "my-stage"
    ws.get(((3 * MIB,), torch.float32))
    stats = ws.stats
    assert stats.size_bytes == ws.size == 12 * MIB
    assert stats.largest_request_bytes == 12 * MIB
    assert stats.num_growths == 3
    assert [g.stage for g in stats.growths] == ["profile", "warmup", "my-stage"]
    assert [(g.old_bytes, g.new_bytes) for g in stats.growths] == [
        (0, MIB), (MIB, 2 * MIB), (2 * MIB, 12 * MIB)
    ]  # fmt: skip
    for g in stats.growths:
        assert os.path.basename(__file__) in g.caller
        assert "test_growth_replaces_buffer_and_records_stage" in g.caller


def test_largest_request_tracks_requests_not_size():
    ws = Workspace("cpu")
    ws.get(((5000,), torch.uint8))
    ws.get(((300,), torch.uint8))
    assert ws.stats.largest_request_bytes == _aligned_total([((5000,), torch.uint8)])
    assert ws.size == MIB


def test_lock_unlock_locked():
    ws = Workspace("cpu")
    assert ws.locked is False
    ws.lock()
    assert ws.locked is True
    ws.lock()  # idempotent
    assert ws.locked is True
    ws.unlock()
    assert ws.locked is False


def test_locked_growth_raises_naming_caller_and_bytes():
    ws = Workspace("cpu")
    ws.stage = "profile"
    ws.get(((4096,), torch.float32))
    held, ptr = ws.size, ws.buffer.data_ptr()
    ws.lock()
    ws.stage = "serving"
    specs = [((held,), torch.uint8), ((10,), torch.float32)]
    asked = _aligned_total(specs)
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(WorkspaceLockedError) as info:
        ws.get(*specs)
    msg = str(info.value)
    # The caller: this file, the line of the call, and this function's name.
    assert f"{__file__}:{line}:test_locked_growth_raises_naming_caller_and_bytes" in msg, msg
    assert f"{asked} bytes" in msg, msg
    assert f"{held} bytes" in msg, msg
    # Nothing changed: same buffer, no growth recorded, still locked.
    assert ws.size == held and ws.buffer.data_ptr() == ptr
    assert ws.stats.num_growths == 1
    assert ws.locked


def _grow_from_helper(ws: Workspace, nbytes: int) -> None:
    ws.get(((nbytes,), torch.uint8))


def test_locked_error_names_the_nearest_caller_outside_the_arena():
    ws = Workspace("cpu")
    ws.lock()
    with pytest.raises(WorkspaceLockedError, match=r"test_workspace\.py:\d+:_grow_from_helper"):
        _grow_from_helper(ws, 1)


def test_locked_request_within_held_size_still_works():
    ws = Workspace("cpu")
    ws.get(((MIB,), torch.uint8))
    ws.lock()
    ptr = ws.buffer.data_ptr()
    a, b = ws.get(((MIB // 2,), torch.uint8), ((1000,), torch.float32))
    (c,) = ws.get(((MIB,), torch.uint8))
    assert a.data_ptr() == c.data_ptr()
    assert b.data_ptr() == a.data_ptr() + MIB // 2
    assert ws.stats.num_growths == 1 and ws.buffer.data_ptr() == ptr


def test_growth_during_profile_and_warmup_does_not_raise_then_lock_does():
    """The startup order: the arena grows freely while profiling and warming
    up, and only after lock() does growth become an error."""
    ws = Workspace("cpu")
    ws.stage = "profile"
    ws.get(((MIB,), torch.uint8))
    ws.stage = "warmup"
    ws.get(((2 * MIB,), torch.uint8))
    ws.stage = "capture"
    ws.get(((2 * MIB,), torch.uint8))  # within the held size: fine
    ws.lock()
    ws.stage = "serving"
    with pytest.raises(WorkspaceLockedError, match="serving"):
        ws.get(((2 * MIB + 1,), torch.uint8))
    assert [g.stage for g in ws.stats.growths] == ["profile", "warmup"]
    # The bypass the hazard tests use: unlocking lets it grow again.
    ws.unlock()
    ws.get(((2 * MIB + 1,), torch.uint8))
    assert ws.stats.growths[-1].stage == "serving"


def test_tickets_are_zeroed_persistent_and_apart_from_the_arena():
    ws = Workspace("cpu")
    ws.stage = "warmup"
    t = ws.tickets(10)
    assert t.dtype == torch.int32 and t.shape == (10,) and not t.any()
    t[3] = 7  # a kernel that did not reset its ticket
    view = ws.get(((4096,), torch.uint8))[0]
    view.fill_(255)  # every op overwrites the arena's bytes; the tickets stay
    again = ws.tickets(10)
    assert again.data_ptr() == t.data_ptr() and again[3] == 7 and again.sum() == 7
    assert ws.stats.num_growths == 2  # one for the tickets, one for the arena
    assert ws.stats.growths[0].stage == "warmup"


def test_locked_ticket_growth_raises_but_held_tickets_are_served():
    ws = Workspace("cpu")
    ws.tickets(5)
    held = ws.num_tickets
    ws.lock()
    assert ws.tickets(held).numel() == held  # within what is held: no growth
    with pytest.raises(WorkspaceLockedError, match=r"asked for \d+ bytes but it holds"):
        ws.tickets(held + 1)
