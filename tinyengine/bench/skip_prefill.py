"""`--skip-prefill` for the latency benchmark: put requests at a long
context without running their prefill.

Owns the one function that reaches past the scheduler's admission: bench
only, never used by the engine. Decode steps after it read exactly what they
would after a real prefill (the same blocks, allocated as a chunked prefill
would, in both cache groups), so their times and roofline stand; the tokens
are meaningless.
"""

from __future__ import annotations

from typing import Any

from tinyengine.bench.common import BenchError


def assume_prefilled(engine: Any, request_ids: list[str], chunk: int = 4096) -> None:
    """Move waiting requests into the running batch with every prompt
    position but the last counted as computed: their blocks are allocated
    chunk by chunk through the block manager, as a chunked prefill would
    (releasing sliding-group blocks on the way), and then the whole cache is
    filled with random numbers. Bench only (--skip-prefill)."""
    import torch

    from tinyengine.scheduling.request import RequestStatus

    scheduler = engine.scheduler
    bm = scheduler.block_manager
    for request_id in request_ids:
        request = engine.states[request_id].request
        scheduler.waiting.remove(request)
        target = request.num_tokens - 1
        while request.num_computed_tokens < target:
            n = min(chunk, target - request.num_computed_tokens)
            if not bm.allocate_slots(request, n):
                raise BenchError("the KV cache cannot hold the batch; lower it or the context")
            request.num_computed_tokens += n
            bm.advance(request)
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        scheduler.running_per_group[request.group] += 1
    for layer in engine.runner.kv_caches:
        for tensor in layer.values() if isinstance(layer, dict) else dict.fromkeys(layer):
            tensor.normal_()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
