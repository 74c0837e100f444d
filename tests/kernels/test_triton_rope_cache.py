"""The fused q/k norm + RoPE + KV-cache write (tinyengine/kernels/rope/triton.py)
against its torch reference (tinyengine/kernels/rope/reference.py), and the
reference against the unfused pieces it replaces: HF's rotary (transformers'
apply_rotary_pos_emb in the activation dtype), the norm reference's RMSNorm
(tinyengine/kernels/norm/reference.py) and the plain cache write."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels.attention.reference import write_kv_cache
from tinyengine.kernels.norm.reference import rms_norm_torch
from tinyengine.kernels.rope.reference import rope_write_kv_torch
from tinyengine.kernels.rope.triton import rope_write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(t: int, hq: int, hkv: int, d: int, dv: int, rot: int, dtype: torch.dtype,
              norm: bool, pad: int, seed: int = 0) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    # q, k, v as strided views of one fused projection output, as the model has them.
    qkv = torch.randn(t, hq * d + hkv * (d + dv) + 4, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d : (hq + hkv) * d + hkv * dv].view(t, hkv, dv)
    max_pos, block_size, num_blocks = 300, 8, 2 + t
    freqs = torch.outer(torch.arange(max_pos).float(), 1.0 / 500 ** (torch.arange(rot // 2) / rot))
    cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[torch.randperm(t, generator=g)[:pad]] = -1
    case = {
        "q": q, "k": k, "v": v,
        "positions": torch.randint(0, max_pos, (t,), generator=g).to(DEVICE),
        "cos_sin_cache": cache,
        "k_cache": torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE),
        "v_cache": torch.randn(num_blocks, block_size, hkv, dv, generator=g).to(dtype).to(DEVICE),
        "slot_mapping": slots.to(DEVICE),
    }  # fmt: skip
    if norm:
        case["q_norm_weight"] = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
        case["k_norm_weight"] = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
        case["eps"] = 1e-5
    return case


def run(fn, case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    c = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q = fn(**c)
    return q, c["k_cache"], c["v_cache"]


def hf_prologue(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the model did before the fusion: norms, HF's rotary, cache write."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = case["q"], case["k"]
    if "q_norm_weight" in case:
        q = rms_norm_torch(q, case["q_norm_weight"], case["eps"])
        k = rms_norm_torch(k, case["k_norm_weight"], case["eps"])
    cos, sin = case["cos_sin_cache"][case["positions"]].to(q.dtype).chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # HF's full-width form
    # HF's layout: [batch, heads, T, D] with cos/sin [batch, T, D].
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    write_kv_cache(k_hf[0].transpose(0, 1), case["v"], k_cache, v_cache, case["slot_mapping"])
    return q_hf[0].transpose(0, 1), k_cache, v_cache


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_hf_prologue(norm: bool, dtype: torch.dtype) -> None:
    case = make_case(t=7, hq=4, hkv=2, d=16, dv=16, rot=16, dtype=dtype, norm=norm, pad=2)
    for ours, ref in zip(run(rope_write_kv_torch, case), hf_prologue(case), strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


SHAPES = [  # (T, Hq, Hkv, D, Dv, rotary dim)
    (5, 4, 2, 16, 16, 16),
    (3, 6, 3, 24, 8, 16),  # head dims not powers of two, partial rotary, Dv != D
    (1, 2, 2, 32, 32, 32),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("norm", [False, True])
def test_triton_matches_reference_fp32(shape: tuple, norm: bool) -> None:
    t, hq, hkv, d, dv, rot = shape
    case = make_case(t, hq, hkv, d, dv, rot, torch.float32, norm, pad=1 if t > 1 else 0)
    for ours, ref in zip(run(rope_write_kv_triton, case), run(rope_write_kv_torch, case),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_triton_equals_reference_bf16(norm: bool) -> None:
    """Every rounding step is the reference's: equal, not close (CPU: the
    interpreter; GPU: compiled)."""
    case = make_case(9, 4, 2, 32, 32, 32, torch.bfloat16, norm, pad=1)
    for ours, ref in zip(run(rope_write_kv_triton, case), run(rope_write_kv_torch, case),
                         strict=True):  # fmt: skip
        assert torch.equal(ours, ref)


def test_padding_rows_touch_no_block() -> None:
    case = make_case(4, 2, 2, 16, 16, 16, torch.float32, norm=False, pad=4)
    _, k_cache, v_cache = run(rope_write_kv_triton, case)
    assert torch.equal(k_cache, case["k_cache"]) and torch.equal(v_cache, case["v_cache"])


def test_rejects_bad_input() -> None:
    case = make_case(2, 2, 2, 16, 16, 16, torch.float32, norm=False, pad=0)
    with pytest.raises(ValueError, match="q_norm_weight and k_norm_weight"):
        rope_write_kv_triton(**dict(case, q_norm_weight=torch.ones(16, device=DEVICE)))
    with pytest.raises(ValueError, match="rotary dim"):
        rope_write_kv_triton(**dict(case, cos_sin_cache=case["cos_sin_cache"][:, :3]))
    with pytest.raises(ValueError, match="do not match"):
        rope_write_kv_triton(**dict(case, k=case["k"][:, :, :8]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("norm", [False, True])
def test_bf16_llama_shapes_match_reference(norm: bool) -> None:
    """Llama-3-8B / Qwen3 head layouts in bf16, compiled: identical to the
    reference except where an fp32 sum of squares in another order moves a
    norm's result by one bf16 step."""
    for hq, hkv in ((32, 8), (16, 8)):
        case = make_case(257, hq, hkv, 128, 128, 128, torch.bfloat16, norm, pad=5)
        for ours, ref in zip(run(rope_write_kv_triton, case), run(rope_write_kv_torch, case),
                             strict=True):  # fmt: skip
            if not norm:
                assert torch.equal(ours, ref)
            else:
                assert (ours == ref).float().mean() > 0.999


@pytest.mark.skipif(DEVICE == "cuda", reason="patches the interpreted kernel's gdc_wait")
def test_reads_the_projection_only_after_the_pdl_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under PDL this kernel starts while the qkv projection before it still
    # writes q, k and v; it reads positions, slots and cos/sin before its
    # wait. Simulated: the projection output is NaN until gdc_wait writes it.
    import tinyengine.kernels.rope.triton as rope

    case = make_case(t=5, hq=4, hkv=2, d=16, dv=16, rot=16, dtype=torch.bfloat16, norm=True,
                     pad=1)  # fmt: skip
    ref = run(rope_write_kv_torch, case)
    qkv = case["q"]._base
    saved = qkv.clone()
    qkv.fill_(float("nan"))
    waits = []

    def wait() -> None:  # the projection finishes: its output is written
        waits.append(1)
        qkv.copy_(saved)

    monkeypatch.setattr(rope, "gdc_wait", wait)
    monkeypatch.setattr(rope, "gdc_launch_dependents", lambda: None)
    monkeypatch.setattr(rope, "pdl_kwargs", lambda device: {"USE_PDL": True})
    out = run(rope_write_kv_triton, case)
    assert waits, "the kernel never waited"
    for ours, want in zip(out, ref, strict=True):
        torch.testing.assert_close(ours, want, rtol=0, atol=0)
