"""tinyengine's kernels/ package vs Hugging Face's `kernels` distribution (same
import name; transformers >= 5.25 requires the latter): with both installed,
importing tinyengine says which one Python found and how to fix it.

A fake distribution stands in for Hugging Face's (a dist-info with a version
and a `kernels` package), first on PYTHONPATH, in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _fake_hf_kernels(root: Path) -> Path:
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
    dist = root / "kernels-0.19.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    return root


def _import_tinyengine(cwd: Path, pythonpath: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO)])
    else:
        env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-W", "always", "-c", "import tinyengine"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip


def test_no_hf_kernels_imports_quietly(tmp_path: Path) -> None:
    proc = _import_tinyengine(REPO, None)
    assert proc.returncode == 0, proc.stderr
    assert "kernels" not in proc.stderr


def test_hf_kernels_found_first_is_a_clear_error(tmp_path: Path) -> None:
    proc = _import_tinyengine(tmp_path, _fake_hf_kernels(tmp_path / "site"))
    assert proc.returncode != 0
    assert "finds Hugging Face's kernels 0.19.1" in proc.stderr
    assert "pip uninstall kernels" in proc.stderr


def test_ours_found_first_warns_that_transformers_will_fail(tmp_path: Path) -> None:
    # cwd = the repo root: sys.path[0] is it, so our kernels/ shadows the fake.
    proc = _import_tinyengine(REPO, _fake_hf_kernels(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    assert "transformers will fail" in proc.stderr
