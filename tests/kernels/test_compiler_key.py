"""kernels/compiler_key.py: Triton's compiler key hashed in a child process
and installed as this process's, only when the child's answer is from the
same Triton."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.runtime.cache as cache  # noqa: E402

from tinyengine.kernels import compiler_key  # noqa: E402


@pytest.fixture
def fresh_key(monkeypatch):
    """As in a fresh process (nothing hashed yet); Triton's own triton_key
    back in place after the test, and no child left over."""
    cache.triton_key.cache_clear()
    monkeypatch.setattr(cache, "triton_key", cache.triton_key)
    yield
    compiler_key.wait()


def test_child_key_is_this_process_key(fresh_key):
    own = cache.triton_key
    compiler_key.start()
    compiler_key.start()  # a second start neither spawns nor loses the first child
    assert compiler_key.wait()
    assert isinstance(cache.triton_key, compiler_key._Known)
    assert cache.triton_key() == own()  # Triton's own function, hashing here
    compiler_key.start()  # installed: nothing left to hash
    assert compiler_key._child is None


def test_key_hashed_here_already_spawns_no_child(fresh_key):
    cache.triton_key()
    compiler_key.start()
    assert compiler_key._child is None
    assert compiler_key.wait()


def test_key_from_another_triton_is_refused(fresh_key, monkeypatch):
    elsewhere = "print('/elsewhere/triton/__init__.py'); print('k')"
    monkeypatch.setattr(compiler_key, "_CHILD", elsewhere)
    original = cache.triton_key
    compiler_key.start()
    assert not compiler_key.wait()
    assert cache.triton_key is original


def test_failing_child_installs_nothing(fresh_key, monkeypatch):
    monkeypatch.setattr(compiler_key, "_CHILD", "raise SystemExit(3)")
    original = cache.triton_key
    compiler_key.start()
    assert not compiler_key.wait()
    assert cache.triton_key is original


def test_wait_without_start_reports_whether_installed(fresh_key):
    assert not compiler_key.wait()


def test_late_child_is_killed_and_installs_nothing(fresh_key, monkeypatch):
    monkeypatch.setattr(compiler_key, "_CHILD", "import time; time.sleep(30)")
    monkeypatch.setattr(compiler_key, "TIMEOUT_S", 0.2)
    original = cache.triton_key
    compiler_key.start()
    child = compiler_key._child
    assert not compiler_key.wait()
    assert child.poll() is not None  # killed, and reaped
    assert cache.triton_key is original


def test_load_installs_the_key_without_a_dry_run(fresh_key):
    """start_precompile (load's, once the model is built) waits for the
    child on every GPU start, also when it compiles nothing ahead (one
    compile thread): the
    child is reaped and its key installed. The runner is a stand-in: a CUDA
    runner cannot exist on a CPU host, and precompile reads only these."""
    from types import SimpleNamespace

    import torch

    from tinyengine.worker.precompile import start_precompile

    compiler_key.start()
    child = compiler_key._child
    runner = SimpleNamespace(
        device=torch.device("cuda"), config=SimpleNamespace(compile_threads=1),
        ops=SimpleNamespace(name="triton"),
    )  # fmt: skip
    assert start_precompile(runner) is None
    assert compiler_key._child is None and child.poll() is not None
    assert isinstance(cache.triton_key, compiler_key._Known)
