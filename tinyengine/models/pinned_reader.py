"""Reading whole safetensors tensors onto a GPU through pinned staging buffers.

safetensors' own reader memory-maps the file, and a copy from that mapping to
the GPU is a pageable copy: every 4 KiB page of the mapping faults in on first
touch, and the CUDA driver stages the bytes through pinned buffers of its own,
one copy at a time, whichever thread asks. This reader parses the file's
header itself (8 bytes of little-endian length, then JSON: each tensor's
dtype, shape and byte range after the header), reads a tensor's bytes with
`pread` into a pinned buffer and copies them to the device asynchronously on
the calling thread's stream. Each thread holds two buffers, so the read of
one chunk overlaps the copy of the one before, and the threads' reads and
copies overlap each other.

Used by models/loader.py for every tensor a parameter takes whole on a CUDA
device; a tensor-parallel rank's slices and CPU loads keep safetensors'
lazy reads (only their part of a tensor is read at all).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# The safetensors dtype names this reader maps; a tensor of another dtype is
# left to safetensors' reader (models/loader.py falls back per tensor).
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# A header larger than this is not a safetensors header (the format's own
# reader refuses the same bound).
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bytes per staging buffer; each reading thread holds two.
CHUNK_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file, and what they are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Name -> TensorEntry for every tensor of a mapped dtype in `path`,
    checked against the file's size (a truncated download fails here)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: it is shorter than its header")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{path} is not a safetensors file: its header claims {header_bytes} bytes"
            )
        header = json.loads(f.read(header_bytes))
    base = 8 + header_bytes
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") not in _DTYPES:
            continue
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise ValueError(
                f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) claims bytes "
                f"[{begin}, {end}) of a {size - base}-byte data section; the file is "
                "truncated or corrupt, fetch it again"
            )
        entries[name] = TensorEntry(dtype, shape, base + begin, nbytes)
    return entries


class StagingBuffers:
    """Two host chunks and the events of the copies out of them: what one
    thread at a time reads through. Pinned for a CUDA device (an
    asynchronous copy needs it); plain for the CPU, where the copy is
    synchronous and there are no events."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        cuda = device.type == "cuda"
        self.chunks = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in "ab"]
        # numpy views of the chunks' memory: pread writes into them directly.
        self.views = [memoryview(chunk.numpy()) for chunk in self.chunks]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None


def read_to_device(
    fd: int, entry: TensorEntry, device: torch.device, staging: StagingBuffers
) -> torch.Tensor:
    """The tensor `entry` of the open file `fd`, on `device`, copied on the
    current stream (ordered before whatever the caller runs on it next)."""
    out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
    chunk_bytes = len(staging.views[0])
    for i, start in enumerate(range(0, entry.nbytes, chunk_bytes)):
        k = i % 2
        if staging.copied is not None:
            # Wait for the copy that last read this chunk (an event never
            # recorded counts as complete).
            staging.copied[k].synchronize()
        n = min(chunk_bytes, entry.nbytes - start)
        _pread_exactly(fd, staging.views[k][:n], entry.offset + start)
        out[start : start + n].copy_(staging.chunks[k][:n], non_blocking=True)
        if staging.copied is not None:
            staging.copied[k].record()
    return out.view(entry.dtype).reshape(entry.shape)


def _pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"the file ended at byte {offset + done}: it is truncated")
        done += got
