"""The decode memory roofline: how many bytes one decode step must read, and
the fastest that step can be at a given read bandwidth.

A decode step of B sequences is memory-bound: it must read every weight it
uses once, plus each sequence's KV cache. So

    step time >= (weights touched + KV read) / read bandwidth
    tokens/s  <= B / that time

Weights touched at batch B:
  - every parameter in full (norms, attention, dense MLPs, shared experts,
    routers, and lm_head -- in full even when tied to the embedding, since
    the logits matmul reads the whole table),
  - except the input embedding table: only its B looked-up rows are read,
  - and the routed experts of an MoE layer: only the experts some token of
    the batch picked. With E experts and K picked per token, and each token's
    choice treated as independent and uniform (each expert picked with
    probability K/E), the expected number of distinct experts touched is

        E * (1 - (1 - K/E) ** B)

    (K at B = 1, tending to E as B grows) -- unless the caller passes the
    counts it measured (routing.py: routers are skewed, random-weight proxies
    too, and then touch fewer).

KV read per step: the cache bytes per token (every layer; for an MLA latent
cache one (kv_lora_rank + qk_rope_head_dim) row per layer) times the context
length of each sequence, times B.

The arithmetic (WeightInventory, decode_roofline) is plain Python and unit
tested by hand; `inventory_from_model` walks a loaded torch model. Must never
run the model or measure anything (membw.py measures the bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E * (1 - (1 - K/E)^B): expected distinct experts picked by B tokens."""
    if num_experts <= 0 or batch <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one MoE layer."""

    nbytes: int  # all E experts' weights (w13 + w2)
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class WeightInventory:
    """A model's weights sorted by how much of them a decode step reads."""

    dense_bytes: int  # read in full every step (lm_head included)
    embedding_row_bytes: int  # one row of the input embedding table(s)
    embedding_rows: int  # rows in that table
    expert_layers: tuple[ExpertLayer, ...] = field(default_factory=tuple)

    def bytes_touched(self, batch: int, experts_touched: list[float] | None = None) -> float:
        """Weight bytes one decode step of `batch` sequences reads;
        `experts_touched`: distinct experts per MoE layer (default: the
        uniform-routing expectation)."""
        total = float(self.dense_bytes)
        total += min(batch, self.embedding_rows) * self.embedding_row_bytes
        for i, layer in enumerate(self.expert_layers):
            if experts_touched is not None:
                touched = experts_touched[i]
            else:
                touched = expected_distinct_experts(layer.num_experts, layer.top_k, batch)
            total += layer.nbytes * touched / layer.num_experts
        return total

    @property
    def total_bytes(self) -> int:
        experts = sum(layer.nbytes for layer in self.expert_layers)
        return self.dense_bytes + self.embedding_rows * self.embedding_row_bytes + experts


@dataclass(frozen=True)
class DecodeRoofline:
    batch: int
    mean_context: float  # tokens of context each sequence's attention reads
    weight_bytes: float
    kv_bytes: float
    bandwidth: float  # bytes/s
    total_bytes: float
    step_s: float  # the fastest possible decode step
    tokens_per_s: float  # batch / step_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_roofline(
    inventory: WeightInventory,
    kv_bytes_per_token: int,
    batch: int,
    mean_context: float,
    bandwidth: float,
    experts_touched: list[float] | None = None,
    kv_read: Callable[[float], float] | None = None,
) -> DecodeRoofline:
    """The roofline of one decode step of `batch` sequences, each attending
    over `mean_context` cached tokens, at `bandwidth` bytes/s (MoE layers:
    `experts_touched` as in WeightInventory.bytes_touched). A sequence reads
    kv_bytes_per_token x mean_context of cache, or `kv_read(mean_context)`
    for a model that reads less than all of it (kv_read_fn)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    weights = inventory.bytes_touched(batch, experts_touched)
    per_seq = kv_read(mean_context) if kv_read else float(kv_bytes_per_token) * mean_context
    kv = per_seq * batch
    total = weights + kv
    step_s = total / bandwidth
    return DecodeRoofline(
        batch, mean_context, weights, kv, bandwidth, total, step_s, tokens_per_s=batch / step_s
    )


def mean_decode_context(prompt_len: int, output_len: int) -> float:
    """Mean context over the decode steps of a P-token prompt and O outputs.
    Decode step j (1 <= j <= O-1) attends over P + j tokens; the mean is
    P + O/2."""
    return prompt_len + output_len / 2


# --- from a loaded model ------------------------------------------------------------


def inventory_from_model(model: Any, hf_config: dict[str, Any] | None = None) -> WeightInventory:
    """Walk a tinyengine model (models/*.py): the input embedding
    (VocabParallelEmbedding that is not lm_head), stacked routed experts
    (modules with w13_weight / w2_weight; K from their MoE block's router
    config, else config.json's num_experts_per_tok), everything else dense."""
    from tinyengine.models.parallel_layers import VocabParallelEmbedding

    lm_head = getattr(model, "lm_head", None)
    top_k_by_experts = {}
    for module in model.modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        cfg = getattr(gate, "cfg", None)
        if experts is not None and cfg is not None and hasattr(cfg, "top_k"):
            top_k_by_experts[id(experts)] = int(cfg.top_k)
    default_k = int((hf_config or {}).get("num_experts_per_tok") or 0)

    dense = row_bytes = rows = 0
    expert_layers: list[ExpertLayer] = []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in params)
        if isinstance(module, VocabParallelEmbedding) and module is not lm_head:
            weight = module.weight
            rows = max(rows, weight.shape[0])
            row_bytes += weight[0].numel() * weight.element_size()
        elif hasattr(module, "w13_weight") and hasattr(module, "w2_weight"):
            num_experts = int(module.w13_weight.shape[0])
            top_k = top_k_by_experts.get(id(module), default_k)
            if not 1 <= top_k <= num_experts:
                raise ValueError(f"cannot tell the top-k of the experts at {module!r}")
            expert_layers.append(ExpertLayer(nbytes, num_experts, top_k))
        else:
            # lm_head lands here in full: a module's own parameters count,
            # tied or not (its matmul reads the whole table).
            dense += nbytes
    return WeightInventory(dense, row_bytes, rows, tuple(expert_layers))


def kv_bytes_per_token(runner: Any) -> int:
    """Cache bytes per resident token over all layers, from the runner's
    model spec (over a block long enough that compressed entries count at
    their rate); with two cache groups the full-history group's, since the
    sliding group's size does not grow with the context."""
    from tinyengine.worker.kv_cache import bytes_per_block

    tokens = 1024
    return bytes_per_block(runner.model.kv_cache_spec(), tokens, runner.dtype) // tokens


def kv_read_fn(runner: Any) -> Callable[[float], float] | None:
    """The cache bytes one sequence's decode step must read at a context,
    when the model says (DeepSeek-V4: its window, the entries it selects or
    scores, the compressor state amortised per window); None: all of it."""
    read = getattr(runner.model, "decode_cache_read_bytes", None)
    if read is None:
        return None
    itemsize = runner.dtype.itemsize
    return lambda context: read(context, itemsize)
