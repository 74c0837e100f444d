"""kernels/jit_monitor.py wired into the installed Triton: its compiler
listener counts the compiles the on-disk cache missed and their time, and
ignores cache hits. The listener is called as Triton's compiler calls it, with
Triton's own CompileTimes (no GPU needed)."""

from __future__ import annotations

import pytest

from tinyengine.kernels import jit_monitor


def test_the_compiler_listener_counts_cache_misses_and_their_time():
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.compilation, "listener"):
        pytest.skip("this Triton has no compiler listener (added in Triton 3.4)")
    assert jit_monitor.install()
    times = knobs.CompileTimes(
        ir_initialization=1_000, lowering_stages=[("ttir", 20_000), ("cubin", 500_000)],
        store_results=4_000,
    )  # fmt: skip
    misses, seconds = jit_monitor.compile_totals()
    call = dict(src=None, metadata={}, metadata_group={}, times=times)
    knobs.compilation.listener(**call, cache_hit=False)
    knobs.compilation.listener(**call, cache_hit=True)
    after_misses, after_seconds = jit_monitor.compile_totals()
    assert after_misses == misses + 1
    assert after_seconds - seconds == pytest.approx(0.525)


def test_a_listener_call_it_cannot_read_is_ignored():
    """Counting must never break a compile: odd calls change nothing."""
    before = jit_monitor.compile_totals()
    jit_monitor._on_listen()
    jit_monitor._on_listen(times=None, cache_hit=False)
    jit_monitor._on_listen(times=object(), cache_hit=False)
    assert jit_monitor.compile_totals() == before
