"""Model-test fixtures: tiny HF model folders built once per session (each
variant ~0.1 s). Tests that modify a checkpoint build
their own folder under tmp_path instead of using these shared ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.hf_models import TINY_VARIANTS, make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            arch, overrides = TINY_VARIANTS[variant]
            built[variant] = make_tiny_hf_model(arch, tmp_path_factory.mktemp(variant), **overrides)
        return built[variant]

    return get
