"""`--compare hf`: the same workload through Hugging Face transformers'
`generate`, for the ratio tinyengine / HF.

HF's setup is its best one that works for every model here, without
compilation: `AutoModelForCausalLM.from_pretrained(folder, dtype=<the dtype
the engine resolved>, attn_implementation="sdpa", device_map=<the engine's
device>)` (native classes only, `trust_remote_code=False`: transformers has
deepseek_v3, qwen3 and llama built in), `.eval()`, under
`torch.inference_mode`, with the default dynamic KV cache. `--hf-cache-implementation static` tries
HF's static cache; without torch.compile it is not faster, and not every
model supports it, so it is not the default. One small generate warms the
model up (CUDA context, cuBLAS handles) before any timing.

Throughput: the prompts are fed in their workload order in batches of
`--hf-batch-size` (default: all at once), left-padded, each batch generating
`max_new_tokens = min_new_tokens = the batch's largest requested output` (so
eos never stops it early, as ignore_eos does for the engine). HF cannot stop
each row at its own length, so it generates the batch maximum for every row;
we credit only each sequence's *requested* output tokens as useful output
(the extra tokens are reported as `wasted_output_tokens`). Sampling matches
the engine's: greedy at temperature 0, else plain temperature sampling (no
top-k / top-p).

Latency: B prompts of P random ids (no padding); prefill = the time of a
generate of 1 new token; per-token decode latency = (time of O new tokens -
time of 1) / (O - 1).

Order: the bench subcommands run HF *first*, then delete it and empty the
caching allocator (`free_accelerator_memory`), then build the engine -- the
engine sizes its KV cache from the free device memory, so HF must be gone
before it starts, and a freshly built HF model is easier to release fully
than an engine holding CUDA graphs.

Must never import transformers at module import time (it is optional), nor
keep the HF model alive after a measurement returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from tinyengine.bench.common import BenchError, free_accelerator_memory, mean, sync


class HFRunner:
    """An HF model loaded for benchmarking; use as a context manager so the
    model is freed when the measurement ends."""

    def __init__(self, folder: str, dtype: Any, device: str, cache_implementation: str | None):
        self.folder, self.dtype, self.device = folder, dtype, device
        self.cache_implementation = cache_implementation
        self.model: Any = None
        self.load_s = 0.0

    def __enter__(self) -> HFRunner:
        import torch

        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise BenchError("--compare hf needs transformers (pip install transformers)") from e
        start = time.perf_counter()
        options = dict(dtype=self.dtype, attn_implementation="sdpa", trust_remote_code=False,
                       use_kernels=False)  # fmt: skip
        try:  # straight onto the device (needs accelerate); else load, then move
            model = AutoModelForCausalLM.from_pretrained(
                self.folder, device_map=self.device, **options
            )
        except (ImportError, ValueError):
            model = AutoModelForCausalLM.from_pretrained(self.folder, **options)
        self.model = model.to(self.device).eval()
        self.pad_id = _pad_id(model.config)
        with torch.inference_mode():
            self.generate([[1] * 4], 2, temperature=0.0)  # warm up
        sync(self.device)
        self.load_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.model = None
        free_accelerator_memory()

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int, temperature: float):
        """Left-padded batch generate of exactly `new_tokens` tokens per row;
        returns the output ids [rows, new_tokens]."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        options: dict[str, Any] = dict(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=self.pad_id,
            do_sample=temperature > 0,
        )
        if temperature > 0:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.cache_implementation:
            options["cache_implementation"] = self.cache_implementation
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **options
            )
        if out.shape[1] != width + new_tokens:
            raise BenchError(f"HF generated {out.shape[1] - width} tokens, asked {new_tokens}")
        return out[:, width:]

    def timed_generate(self, prompts, new_tokens: int, temperature: float) -> float:
        sync(self.device)
        start = time.perf_counter()
        self.generate(prompts, new_tokens, temperature)
        sync(self.device)
        return time.perf_counter() - start


def _pad_id(config: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def hf_throughput(
    runner: HFRunner,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    temperature: float,
    batch_size: int | None,
    seed: int,
) -> dict[str, Any]:
    """Run the throughput workload; figures as the engine's are named."""
    import torch

    torch.manual_seed(seed)
    batch_size = batch_size or len(prompts)
    generated = 0
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        chunk, wants = prompts[lo : lo + batch_size], max_tokens[lo : lo + batch_size]
        out = runner.generate(chunk, max(wants), temperature)
        generated += out.numel()
    sync(runner.device)
    elapsed = time.perf_counter() - start
    useful = sum(max_tokens)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "batch_size": batch_size,
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "wasted_output_tokens": generated - useful,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (prompt_tokens + useful) / elapsed,
        "load_s": runner.load_s,
        "cache_implementation": runner.cache_implementation or "dynamic",
    }


def hf_latency(
    runner: HFRunner,
    make_prompts: Callable[[], list[list[int]]],  # B prompts, fresh ids each call
    batch: int,
    output_len: int,
    num_iters: int,
    warmup_iters: int,
    temperature: float,
) -> dict[str, Any]:
    """Prefill time and per-token decode latency at one batch size."""
    one: list[float] = []
    full: list[float] = []
    for i in range(warmup_iters + num_iters):
        t1 = runner.timed_generate(make_prompts(), 1, temperature)
        to = runner.timed_generate(make_prompts(), output_len, temperature)
        if i >= warmup_iters:
            one.append(t1)
            full.append(to)
    prefill_s, full_s = mean(one), mean(full)
    decode_s = (full_s - prefill_s) / max(output_len - 1, 1)
    return {
        "batch_size": batch,
        "prefill_ms": prefill_s * 1000,
        "generate_ms": full_s * 1000,
        "decode_step_ms": decode_s * 1000,
        "decode_tokens_per_s": batch / decode_s if decode_s > 0 else float("nan"),
        "load_s": runner.load_s,
        "cache_implementation": runner.cache_implementation or "dynamic",
    }


def hf_startup(folder: str, dtype: Any, device: str) -> dict[str, Any]:
    """Seconds from nothing to a model that has run one generate."""
    with HFRunner(folder, dtype, device, None) as runner:
        return {"load_s": runner.load_s}


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs; nan when either is not a positive number."""
    if not (ours > 0 and theirs > 0 and math.isfinite(ours) and math.isfinite(theirs)):
        return math.nan
    return ours / theirs
