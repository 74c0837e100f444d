"""tinyengine/models/pinned_reader.py: its own safetensors header parse and
chunked reads give what safetensors' reader gives, for every mapped dtype,
scalar and empty tensors, and tensors that span many chunks; a truncated or
corrupt file fails with an error naming it. On the CPU the staging buffers
are plain memory; the GPU test runs the pinned, asynchronous path."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyengine.models.pinned_reader import StagingBuffers, read_header, read_to_device


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(37, 129, generator=gen)
    return {
        "bf16": floats.to(torch.bfloat16),
        "f16": floats[:5].to(torch.float16),
        "f32": floats[:, :3].contiguous(),
        "f64": floats[0].double(),
        "fp8": floats[:7].to(torch.float8_e4m3fn),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(11, dtype=torch.int32),
        "u8": torch.arange(250, dtype=torch.uint8).reshape(10, 25),
        "bool": torch.arange(9) % 2 == 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def _read_all(path: Path, device: str, chunk_bytes: int) -> dict[str, torch.Tensor]:
    header = read_header(path)
    staging = StagingBuffers(torch.device(device), chunk_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        return {
            name: read_to_device(fd, e, torch.device(device), staging) for name, e in header.items()
        }
    finally:
        os.close(fd)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    # Bit-exact, NaN-safe: fp8 draws may hold NaN, which equal() never matches.
    return tensor.reshape(-1).view(torch.uint8)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bytes(got[name].cpu()), _bytes(tensor)), name


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_reads_what_safetensors_reads(tmp_path: Path, chunk_bytes: int) -> None:
    # 7 bytes: chunks that split every element; 64: many chunks a tensor.
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata={"format": "pt"})
    _assert_same(_read_all(path, "cpu", chunk_bytes), load_file(path))


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        read_header(path)


def test_file_that_is_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter than its header"):
        read_header(path)


def test_a_file_cut_after_its_header_check_fails_the_read(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(1000)}, path)
    header = read_header(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="truncated"):
            read_to_device(
                fd, header["w"], torch.device("cpu"), StagingBuffers(torch.device("cpu"), 64)
            )
    finally:
        os.close(fd)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_pinned_reads_onto_the_gpu(tmp_path: Path, chunk_bytes: int) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = _read_all(path, "cuda", chunk_bytes)
    stream.synchronize()
    assert all(t.is_cuda for t in got.values())
    _assert_same(got, load_file(path))
