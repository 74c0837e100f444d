"""Triton's FP-fusion default pinned by tinyengine.kernels (kernels/__init__.py):
fusion stays on, without Triton's warning, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import warnings
warnings.simplefilter("error")  # Triton's notice about the default is a warning
import tinyengine.kernels
from triton import knobs
language = knobs.language
# What a launch that names no enable_fp_fusion compiles with (3.9 asks, and
# warns, through fp_fusion_enabled; earlier versions read the default).
ask = getattr(language, "fp_fusion_enabled", None)
print(ask(None) if ask is not None else language.default_fp_fusion)
"""


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_fusion_stays_on_without_a_warning() -> None:
    pytest.importorskip("triton")
    assert _probe() == "True"


def test_the_users_choice_wins() -> None:
    pytest.importorskip("triton")
    assert _probe(TRITON_DEFAULT_FP_FUSION="0") == "False"
