"""kernels/jit_monitor.py wired into the installed Triton: its compiler
listener adds up the time of the compiles the on-disk cache missed, and
ignores cache hits. The listener is called as Triton's compiler calls it, with
Triton's own CompileTimes (no GPU needed)."""

from __future__ import annotations

import pytest

from tinyengine.kernels import jit_monitor


def test_the_compiler_listener_times_cache_misses_only():
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 has no hooks: nothing is counted
        assert not jit_monitor.install()
        return
    assert jit_monitor.install()
    # Every Triton with knobs has the listener; one without it would leave
    # the startup report's compile seconds at 0, which this should catch.
    assert knobs.compilation.listener is not None
    times = knobs.CompileTimes(
        ir_initialization=1_000, lowering_stages=[("ttir", 20_000), ("cubin", 500_000)],
        store_results=4_000,
    )  # fmt: skip
    before = jit_monitor.compile_seconds()
    call = dict(src=None, metadata={}, metadata_group={}, times=times)
    knobs.compilation.listener(**call, cache_hit=False)
    assert jit_monitor.compile_seconds() - before == pytest.approx(0.525)
    knobs.compilation.listener(**call, cache_hit=True)
    assert jit_monitor.compile_seconds() - before == pytest.approx(0.525)


def test_a_listener_call_it_cannot_read_is_ignored():
    """Counting must never break a compile: odd calls change nothing."""
    before = jit_monitor.compile_seconds()
    jit_monitor._on_listen()
    jit_monitor._on_listen(times=None, cache_hit=False)
    jit_monitor._on_listen(times=object(), cache_hit=False)
    assert jit_monitor.compile_seconds() == before


def test_counts_from_concurrent_compiles_add_up():
    """compile_ahead's pool threads call the hooks at once; no count is lost."""
    import sys
    import threading

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    threads, calls = 8, 5_000
    count, seconds = jit_monitor.num_compiles(), jit_monitor.compile_seconds()

    def compile_many() -> None:
        for _ in range(calls):
            jit_monitor._on_compile(repr="k")
            jit_monitor.add_compile_seconds(1e-6)

    try:
        workers = [threading.Thread(target=compile_many) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(previous)
    assert jit_monitor.num_compiles() - count == threads * calls
    assert jit_monitor.compile_seconds() - seconds == pytest.approx(threads * calls * 1e-6)
