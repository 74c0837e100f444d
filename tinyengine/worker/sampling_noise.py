"""The sampler's randomness: where each row's noise comes from.

Owns the rule that makes a seeded request reproducible whatever shares its
batch: a seeded row draws only from its own generator, and exactly as much
per sampled step whatever the batch (the torch path: `vocab` Exp(1) draws;
the fused path: one int64 seed, the kernel's noise being a pure function of
it). Unseeded rows share the sampler's generator; greedy rows draw nothing.
Everything is drawn on the device: no host sync.
"""

from __future__ import annotations

import torch

# Seeds for the fused kernel's noise are drawn in [0, 2**62): 62 random bits of
# the 64-bit Philox key, plenty to never repeat a stream in practice.
SEED_HIGH = 2**62


def draw_seeds(
    device: torch.device,
    shared: torch.Generator,
    generators: list[torch.Generator | None],
    greedy: list[bool],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One int64 seed per row on the device for the fused kernel's noise
    (into `out` when given): unseeded sampled rows share one draw from the
    `shared` generator, each seeded sampled row draws exactly one value from
    its own generator, and greedy rows draw nothing (their seed is never
    read)."""
    live = [not g for g in greedy]
    seeds = torch.empty(len(greedy), dtype=torch.int64, device=device) if out is None else out
    if any(ok and g is None for g, ok in zip(generators, live, strict=True)):
        # torch.randint's own draw: random_(0, high) on an empty tensor.
        seeds.random_(0, SEED_HIGH, generator=shared)
    elif out is None:
        seeds.zero_()
    for i, (g, ok) in enumerate(zip(generators, live, strict=True)):
        if ok and g is not None:
            seeds[i : i + 1].random_(0, SEED_HIGH, generator=g)
    return seeds


def exponential_noise(
    probs: torch.Tensor,
    shared: torch.Generator,
    generators: list[torch.Generator | None],
    greedy: list[bool],
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] for the torch path's exponential race. A
    seeded row's noise comes only from its own generator, exactly `vocab`
    draws per step, so its stream is the same whatever the batch; unseeded
    rows share the `shared` generator."""
    live = [not g for g in greedy]
    seeded = [
        i for i, (g, ok) in enumerate(zip(generators, live, strict=True)) if ok and g is not None
    ]
    if any(ok and g is None for g, ok in zip(generators, live, strict=True)):
        noise = torch.empty_like(probs).exponential_(generator=shared)
    else:
        noise = torch.ones_like(probs)  # greedy rows' noise is never looked at
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    # Some backends' exponential_ can return an exact 0 (pytorch#48841,
    # #192577): 0/0 = NaN would win the argmax and pick a masked token.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
