"""Measure the device's memory read bandwidth, for the decode roofline.

One large contiguous buffer (far larger than any cache: 4 GiB on a GPU) is
read by a few full reductions -- `sum` over it viewed as fp32 and as bf16,
and `amax` over fp32 -- each timed several times. A reduction reads every
byte once and writes one number, so bytes / time is the read bandwidth. The
fastest reading (best method, best repetition) is the figure: it is what a
well-written kernel can reach on this device, in this process, right now.
On CUDA, intervals come from CUDA events; on CPU, from perf_counter.

Owns only that measurement. Allocates its buffer and frees it before
returning; must be called while enough device memory is free (the latency
bench measures before it builds the engine).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # the best reading
    method: str  # which reduction gave it
    nbytes: int  # buffer size read per repetition
    per_method: dict[str, float]  # method -> its best bytes/s
    device: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_nbytes(device: str) -> int:
    """4 GiB on a GPU (well beyond L2); 256 MiB on CPU (beyond its caches,
    and quick enough for a CI machine)."""
    return 4 * GIB if device.startswith("cuda") else 256 * 2**20


def read_bandwidth(device: str, gib: float | None, given_gbps: float | None) -> dict[str, Any]:
    """The bandwidth the roofline uses: `given_gbps` if set, else measured
    with a buffer of `gib` GiB (default_nbytes if None)."""
    if given_gbps:
        return {"bytes_per_s": given_gbps * 1e9, "method": "given", "device": device}
    nbytes = int(gib * GIB) if gib else None
    return measure_read_bandwidth(device, nbytes).as_dict()


def measure_read_bandwidth(device: str, nbytes: int | None = None, reps: int = 10) -> Bandwidth:
    import torch

    nbytes = nbytes or default_nbytes(device)
    nbytes -= nbytes % 16
    methods = {
        "sum_fp32": lambda x: x.sum(),
        "sum_bf16": lambda x: x.view(torch.bfloat16).sum(),
        "amax_fp32": lambda x: x.amax(),
    }
    results: dict[str, float] = {}
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    try:
        for name, fn in methods.items():
            results[name] = nbytes / _best_seconds(lambda f=fn: f(buffer), device, reps)
    finally:
        buffer = None  # free it before the engine is built
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    best = max(results, key=results.__getitem__)
    return Bandwidth(results[best], best, nbytes, results, device)


def _best_seconds(fn, device: str, reps: int) -> float:
    import torch

    fn()  # first call: kernel selection, page faults
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        return min(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
