"""Measured expert routing for the decode roofline of an MoE model.

The roofline (roofline.py) counts the routed experts a decode batch touches.
Its default assumes each token picks its K experts uniformly at random; a
real router -- and a random-weight proxy's too, whose hidden states share
directions after a few random layers -- concentrates on fewer experts, so the
uniform count overstates the bytes a step must read (the 4-layer
deepseek-v3-proxy's batch-64 decode step runs faster than the uniform
"roofline" allows; docs/benchmarks.md).

So the latency benchmark measures it: one eager prefill of random prompts of
the benchmark's shape with a forward hook on every MoE router records each
token's expert ids, and the experts touched by a batch of B decode rows is
the mean number of distinct ids among B tokens drawn from those (any position
of a prompt stands in for a decode row: both are one token routed on its own
hidden state). Runs the model; numbers only (no timing).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def routers(model: Any) -> list[Any]:
    """The router (`gate`) of every routed-expert block, in module order: the
    order of roofline.inventory_from_model's expert layers."""
    return [
        module.gate
        for module in model.modules()
        if hasattr(getattr(module, "experts", None), "w13_weight")
        and getattr(module, "gate", None) is not None
    ]


def record_routing(llm: Any, prompts: list[list[int]]) -> list[np.ndarray]:
    """Per MoE layer, the expert ids [tokens, K] the router chose for every
    prompt token, from one `generate(max_tokens=1)` (an eager prefill: the
    hooks would not run inside a replayed CUDA graph). [] for a dense model."""
    from tinyengine.sampling_params import SamplingParams

    gates = routers(llm.engine.runner.model)
    seen: list[list[np.ndarray]] = [[] for _ in gates]

    def keep(i: int):
        # A router returns (weights, ids); the copy to the host syncs, which
        # is fine here: nothing is being timed.
        return lambda module, args, out: seen[i].append(out[1].detach().cpu().numpy())

    handles = [gate.register_forward_hook(keep(i)) for i, gate in enumerate(gates)]
    try:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
    return [np.concatenate(ids) for ids in seen]


def distinct_experts(ids: np.ndarray, batch: int, draws: int = 16, seed: int = 0) -> float:
    """Mean number of distinct experts picked by `batch` tokens drawn (without
    replacement) from the recorded `ids` [tokens, K]."""
    rng = np.random.default_rng(seed)
    take = min(batch, len(ids))
    counts = [len(np.unique(ids[rng.choice(len(ids), take, replace=False)])) for _ in range(draws)]
    return float(np.mean(counts))
