"""load_format="dummy" (vLLM's name): seeded random weights made on the
model's device, no checkpoint read, for any architecture. A 4-layer proxy of
a model with real widths is tens of GB: writing it to disk and reading it
back buys nothing when only speed and memory are being measured.

Owns the initialisation rule: a matrix (2-D or more) is normal(0, std) with
std = config.json's initializer_range (0.02 if absent), so routers pick
varied experts and logits are not flat; a vector is 1 when its name says it
is a norm weight or a scale (so activations keep their size) and 0
otherwise (biases, sinks, position biases); an integer parameter (a hash
router's token -> expert table) draws ids in the range its module declares
(`param.value_range`). Each tensor's values depend only on (seed, name):
the same in every run and whatever the build order.

Must never read weight files.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

# A folder holding this file has no weights by design (a dummy-weight
# preset), so load_format="auto" makes them up instead of failing.
DUMMY_MARKER = "tinyengine-dummy-weights"
_CHUNK = 1 << 24


def init_dummy_weights(model: nn.Module, std: float, seed: int = 0) -> None:
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        with torch.no_grad():
            if not param.dtype.is_floating_point:
                low, high = getattr(param, "value_range", (0, 1))
                param.copy_(torch.randint(low, high, param.shape, generator=gen,
                                          device=param.device))  # fmt: skip
            elif param.dim() >= 2:
                flat = param.view(-1)
                for start in range(0, flat.numel(), _CHUNK):
                    n = min(_CHUNK, flat.numel() - start)
                    noise = torch.randn(n, generator=gen, device=param.device) * std
                    flat[start : start + n] = noise.to(param.dtype)
            else:
                # The module's and the parameter's own names, e.g. "kv_norm", "weight".
                parts = name.rsplit(".", 2)
                is_one = any(word in part for part in parts for word in ("norm", "scale"))
                param.fill_(1.0 if is_one else 0.0)
