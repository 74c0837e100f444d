"""benchmarks/bench_gemv.py's dry run (CPU): the shapes and the configs the
skinny kernel would take, per model, without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gemv.py"


def _dry_run(*args: str) -> str:
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-0.6b"])
def test_dry_run_lists_the_models_shapes(model: str) -> None:
    out = _dry_run("--model", model)
    n_k = {"llama3-8b": "('qkv', 6144, 4096)", "qwen3-0.6b": "('qkv', 4096, 1024)"}[model]
    assert n_k in out


def test_qwen_rows_past_the_kernel_get_no_config() -> None:
    # 64 rows take the kernel's DOT loop; 256 rows are cuBLAS's, so no config
    out = _dry_run("--model", "qwen3-0.6b")
    assert "o_proj   M=64: dot BN=32 BK=128 w=4 s=4 split=5" in out
    assert "M=256:" not in out


def test_many_row_sweep_only_where_the_model_has_those_rows() -> None:
    # qwen3-0.6b's rows reach 64 on the DOT loop: its sweep covers 16-64 rows
    # with tiles split over K; Llama-3-8B's stop at 8.
    assert "M in [16, 32, 64] sweep: 48 DOT tiles" in _dry_run("--model", "qwen3-0.6b")
    assert "M in [16, 32, 64]" not in _dry_run("--model", "llama3-8b")
