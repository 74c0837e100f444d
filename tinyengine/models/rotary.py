"""Rotary position embeddings (RoPE) in the "neox" / rotate-half layout that HF
Llama, Qwen2 and Qwen3 use, plus the parsing of a config.json's rope settings
and the frequencies of every rope type (shared with DeepSeek's MLA rotary).

Owns the cos/sin cache: computed once on the host in fp32 at construction, for
every position up to max_position_embeddings, so a forward step only gathers
rows (no trig, no host sync, graph-safe). Must never compute frequencies inside
forward.

config.json comes in two spellings and both must work:
  * transformers < 5: top-level "rope_theta" and optional
    "rope_scaling": {"rope_type" | "type": ..., "factor": ..., ...}
  * transformers >= 5: "rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tinyengine.kernels.rope.reference import gather_cos_sin, rotate_neox

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_ROPE_THETA = 10000.0


def get_rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """One flat dict {rope_type, rope_theta, ...} from either config.json spelling.
    As in transformers, a legacy rope_scaling dict, when given, replaces
    rope_parameters whole (transformers 5 writes rope_parameters on save, so
    YaRN added to a saved config in DeepSeek's spelling sits beside it)."""
    params: dict[str, Any] = dict(
        hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    )
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            "per-layer-type rope_parameters (a nested dict) are not supported by the "
            "Llama family here; config.json must hold one flat rope_parameters dict"
        )
    # Old configs say "type"; new ones "rope_type".
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if "partial_rotary_factor" in hf_config:  # old spelling: top level
        params.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    theta = params.get("rope_theta", hf_config.get("rope_theta", _DEFAULT_ROPE_THETA))
    params["rope_theta"] = float(theta)
    if params["rope_type"] in ("llama3", "yarn"):
        # As transformers does: a top-level original_max_position_embeddings
        # (Phi-3's spelling) wins over the rope dict's; without either, the
        # pretraining context is the current one.
        if "original_max_position_embeddings" in hf_config:
            params["original_max_position_embeddings"] = hf_config[
                "original_max_position_embeddings"
            ]
        else:
            params.setdefault(
                "original_max_position_embeddings", hf_config.get("max_position_embeddings")
            )
    return params


def rope_frequencies(
    rot_dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim // 2] fp32, attention_factor), computed exactly as HF
    does so that cos/sin match bit for bit; attention_factor multiplies cos
    and sin (1.0 except under YaRN)."""
    base = params["rope_theta"]
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(base**exponents, rot_dim, params, max_position_embeddings)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported types are "
        f"{list(SUPPORTED_ROPE_TYPES)} (set in config.json rope_parameters/rope_scaling)"
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(pos_freqs: torch.Tensor, rot_dim: int, params: dict[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:  # fmt: skip
    """YaRN (HF's _compute_yarn_parameters): dims that rotate many times in
    the original context keep their frequency, slow ones are interpolated by
    `factor`, the band between blends linearly; cos/sin are scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek) or
    mscale(factor), unless attention_factor is given."""
    base = params["rope_theta"]
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The rotary dim whose wavelength fits `num_rotations` times in the
        # original context.
        return rot_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    steps = torch.arange(rot_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((steps - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by `factor`,
    short ones kept, and the band between is blended smoothly."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RopeCache(nn.Module):
    """Owns a rotary module's cos/sin cache: a non-persistent buffer (never in
    a checkpoint) of [cos | sin] * attention_factor per position, computed on
    the host in fp32 for positions [0, max_position_embeddings).
    `cover_positions(n)` extends it when the engine serves longer sequences
    (max_model_len past max_position_embeddings,
    EngineConfig.allow_long_max_model_len): RoPE is defined at every position
    and HF computes it on the fly, so the extension is what HF would use."""

    def _init_cache(self, inv_freq: torch.Tensor, attention_factor: float, num_positions: int,
                    dtype: torch.dtype) -> None:  # fmt: skip
        self._inv_freq, self._attention_factor = inv_freq, attention_factor
        cache = self._cos_sin(num_positions)
        self.register_buffer(
            "cos_sin_cache", cache.to(device=torch.get_default_device(), dtype=dtype),
            persistent=False,
        )  # fmt: skip

    def _cos_sin(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, self._inv_freq)  # [P, rot_dim // 2]
        # As HF: cos/sin times the attention factor (YaRN's), in fp32.
        factor = self._attention_factor
        return torch.cat([freqs.cos() * factor, freqs.sin() * factor], -1)

    def cover_positions(self, num_positions: int) -> None:
        old = self.cos_sin_cache
        if num_positions > old.shape[0]:
            self.cos_sin_cache = self._cos_sin(num_positions).to(device=old.device, dtype=old.dtype)


class RotaryEmbedding(RopeCache):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at the given positions.

    The cache ([max_position, rot_dim], RopeCache) follows the model's dtype
    when the model is cast: HF also rounds cos/sin to the activation dtype
    before multiplying, so results match HF in bf16 as well.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_parameters: dict[str, Any],
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # Only the first rotary_dim lanes of each head rotate (partial RoPE);
        # the Llama family rotates all of them.
        self.rot_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rot_dim % 2 != 0 or not 0 < self.rot_dim <= head_dim:
            raise ValueError(
                f"rotary_dim={self.rot_dim} must be even and in (0, head_dim={head_dim}]"
            )
        self.max_position_embeddings = max_position_embeddings
        inv_freq, attention_factor = rope_frequencies(
            self.rot_dim, rope_parameters, max_position_embeddings
        )
        self._init_cache(
            inv_freq, attention_factor, max_position_embeddings, torch.get_default_dtype()
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = gather_cos_sin(self.cos_sin_cache, positions, q.dtype)
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
