"""DeepSeek-V4's mHC ops (tinyengine/kernels/mhc): the torch reference against
the hyper-connection math as Hugging Face writes it (RMS norm before the
projection, inline below as the oracle), the model's modules wired onto the
ops, and the Triton kernels against the reference -- on CPU under the
interpreter, and at V4-Flash sizes on a GPU, eager and inside a CUDA graph."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tinyengine.kernels import torch_ops
from tinyengine.kernels.mhc import reference as ref
from tinyengine.kernels.mhc import triton as tri
from tinyengine.models.hyper_connections import HyperConnection, HyperHead

HC_EPS, NORM_EPS = 1e-6, 1e-6
# fp32: only rounding differs (the norm's factor applied after the projection,
# another summation order). The weights lie in [0, 2]; collapsed and expanded
# streams are sums of terms up to ~20 that may cancel, hence their atol.
F32_W = dict(rtol=1e-5, atol=1e-6)
F32 = dict(rtol=1e-5, atol=1e-5)
# bf16 outputs: a couple of ulps (2^-8 relative); the interpreter truncates
# fp32 -> bf16 where torch rounds, and mhc_post rounds three times.
BF16 = dict(rtol=2**-5, atol=2**-5)


def hf_hyper_connection(streams, fn, base, scale, iters):
    """DeepseekV4HyperConnection's forward: norm, projection, weights, Sinkhorn."""
    hc = streams.shape[1]
    x = streams.flatten(1).float()
    flat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)
    pre_w, post_w, comb_w = (flat @ fn.t()).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + HC_EPS
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1)
    comb = comb + HC_EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hf_hyper_head(streams, fn, base, scale):
    x = streams.flatten(1).float()
    flat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)
    pre = torch.sigmoid((flat @ fn.t()) * scale + base) + HC_EPS
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hf_expand(streams, post, comb, out):
    dtype = streams.dtype
    return (
        post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dtype).transpose(1, 2) @ streams
    )


def _case(tokens, hc, dim, dtype=torch.float32, seed=0, device="cpu", head=False):
    """Streams of rms ~2 and a projection whose normalised mixes are ~N(0, 1):
    the weights land in the ranges a trained model's do, not all saturated."""
    g = torch.Generator().manual_seed(seed)
    width = hc if head else (2 + hc) * hc
    streams = (2 * torch.randn(tokens, hc, dim, generator=g)).to(dtype)
    fn = torch.randn(width, hc * dim, generator=g) / (hc * dim) ** 0.5
    base = 0.5 * torch.randn(width, generator=g)
    scale = 0.5 + torch.rand(1 if head else 3, generator=g)
    out = (2 * torch.randn(tokens, dim, generator=g)).to(dtype)
    return [t.to(device) for t in (streams, fn, base, scale, out)]


def _mixes(streams, fn):
    return streams.flatten(1).float() @ fn.t()


def _close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    torch.testing.assert_close(a.float(), b.float(), **tol)


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("iters", [1, 3, 20])
def test_reference_matches_hf_math(hc, tokens, dim, iters):
    streams, fn, base, scale, out = _case(tokens, hc, dim, seed=tokens * dim + iters)
    want = hf_hyper_connection(streams, fn, base, scale, iters)
    got = ref.mhc_pre(
        streams, _mixes(streams, fn), base, scale, iters=iters, hc_eps=HC_EPS, norm_eps=NORM_EPS
    )
    for g, w, tol in zip(got, want, (F32_W, F32_W, F32), strict=True):
        _close(g, w, tol)
    # The last Sinkhorn step normalises columns: they sum to 1 up to eps.
    torch.testing.assert_close(got[1].sum(-2), torch.ones(tokens, hc), rtol=0, atol=1e-5)
    h_streams, h_fn, h_base, h_scale, _ = _case(tokens, hc, dim, seed=tokens, head=True)
    got = ref.mhc_head(
        h_streams, _mixes(h_streams, h_fn), h_base, h_scale, hc_eps=HC_EPS, norm_eps=NORM_EPS
    )
    _close(got, hf_hyper_head(h_streams, h_fn, h_base, h_scale), F32)
    post, comb, _ = want
    assert torch.equal(ref.mhc_post(streams, post, comb, out), hf_expand(streams, post, comb, out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_call_the_ops(dtype):
    """HyperConnection / HyperHead project in fp32 and hand the rest to the op
    set: their outputs are HF's, with the checkpoint's parameter names."""
    hc, dim, iters = 4, 64, 20
    args = SimpleNamespace(
        hc_mult=hc, hc_iters=iters, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS, hidden_size=dim
    )
    conn, head = HyperConnection(args), HyperHead(args)
    assert {n for n, _ in conn.named_parameters()} == {"fn", "base", "scale"}
    assert {n for n, _ in head.named_parameters()} == {"hc_fn", "hc_base", "hc_scale"}
    streams, fn, base, scale, _ = _case(9, hc, dim, dtype=dtype, seed=3)
    _, h_fn, h_base, h_scale, _ = _case(9, hc, dim, seed=4, head=True)
    for name, value, h_value in [
        ("fn", fn, h_fn),
        ("base", base, h_base),
        ("scale", scale, h_scale),
    ]:
        getattr(conn, name).data.copy_(value)
        getattr(head, "hc_" + name).data.copy_(h_value)
    ops = torch_ops()
    want = hf_hyper_connection(streams, fn, base, scale, iters)
    for g, w, tol in zip(conn(streams, ops), want, (F32_W, F32_W, F32), strict=True):
        _close(g, w, tol)
    _close(head(streams, ops), hf_hyper_head(streams, h_fn, h_base, h_scale), F32)


# ----------------------------------------------------------------------------- Triton kernels


def _pre_both(streams, fn, base, scale, iters):
    mixes = _mixes(streams, fn)
    kw = dict(iters=iters, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    return ref.mhc_pre(streams, mixes, base, scale, **kw), tri.mhc_pre(
        streams, mixes, base, scale, **kw
    )


def _head_both(streams, fn, base, scale):
    mixes = _mixes(streams, fn)
    kw = dict(hc_eps=HC_EPS, norm_eps=NORM_EPS)
    return ref.mhc_head(streams, mixes, base, scale, **kw), tri.mhc_head(
        streams, mixes, base, scale, **kw
    )


def _check_all(tokens, hc, dim, iters, dtype, seed, device, out_tol, w_tol=F32_W):
    streams, fn, base, scale, out = _case(tokens, hc, dim, dtype, seed, device)
    want, got = _pre_both(streams, fn, base, scale, iters)
    _close(got[0], want[0], w_tol)  # post, comb: fp32 from the same inputs
    _close(got[1], want[1], w_tol)
    _close(got[2], want[2], out_tol)
    post, comb = want[0], want[1]
    _close(tri.mhc_post(streams, post, comb, out), ref.mhc_post(streams, post, comb, out), out_tol)
    h_streams, h_fn, h_base, h_scale, _ = _case(tokens, hc, dim, dtype, seed + 1, device, True)
    want, got = _head_both(h_streams, h_fn, h_base, h_scale)
    _close(got, want, out_tol)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("tokens", [1, 7, 37])
@pytest.mark.parametrize("dim", [64, 96, 256])  # 96: a masked tail
@pytest.mark.parametrize("iters", [1, 20])
def test_triton_matches_reference_fp32(hc, tokens, dim, iters):
    _check_all(tokens, hc, dim, iters, torch.float32, tokens + dim, "cpu", F32)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("tokens", [1, 13])
def test_triton_matches_reference_bf16(hc, tokens):
    _check_all(tokens, hc, 160, 20, torch.bfloat16, tokens, "cpu", BF16)


@pytest.mark.parametrize("token_tile", [1, 4])
def test_triton_token_tiles(monkeypatch, token_tile):
    """The GPU's one token per program (the interpreter's default packs all
    tokens into one), and tiles whose last one runs past the tokens."""
    monkeypatch.setattr(tri, "_token_tile", lambda *_: token_tile)
    _check_all(7, 4, 96, 20, torch.float32, 11, "cpu", F32)
    _check_all(5, 2, 64, 3, torch.bfloat16, 12, "cpu", BF16)


def test_triton_strided_operands_and_no_tokens():
    """Row-strided streams and block output (views into wider buffers) read
    right; D larger than one tile loops; zero tokens launch nothing."""
    hc, dim, tokens = 4, 1100, 3
    streams, fn, base, scale, out = _case(tokens, hc, dim, seed=7)
    wide = torch.zeros(tokens, hc, dim + 36)
    wide[..., :dim] = streams
    wide_out = torch.zeros(tokens, dim + 12)
    wide_out[:, :dim] = out
    want, got = _pre_both(streams, fn, base, scale, 20)
    got_strided = tri.mhc_pre(
        wide[..., :dim], _mixes(streams, fn), base, scale, iters=20,
        hc_eps=HC_EPS, norm_eps=NORM_EPS,
    )  # fmt: skip
    for g, s, w, tol in zip(got, got_strided, want, (F32_W, F32_W, F32), strict=True):
        _close(g, w, tol)
        assert torch.equal(g, s)
    post, comb = want[0], want[1]
    _close(
        tri.mhc_post(wide[..., :dim], post, comb, wide_out[:, :dim]),
        ref.mhc_post(streams, post, comb, out),
        F32,
    )
    empty = streams[:0]
    post, comb, collapsed = tri.mhc_pre(
        empty, _mixes(empty, fn), base, scale, iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS
    )
    assert post.shape == (0, hc) and comb.shape == (0, hc, hc) and collapsed.shape == (0, dim)
    assert tri.mhc_post(empty, post, comb, out[:0]).shape == (0, hc, dim)


# ----------------------------------------------------------------------------- GPU, V4-Flash sizes

V4_FLASH = dict(hc=4, dim=4096, iters=20)
# On a GPU both sides round fp32 -> bf16 alike; summation order may move a
# rounded term (streams up to ~12 here, ulp 2^-4) by one ulp, and a sum that
# cancels keeps that absolute error: two ulps of the largest term.
GPU_BF16 = dict(rtol=2**-7, atol=2**-3)
# The GPU's exp and fp32 division are approximate (~2 ulp) and the Sinkhorn
# loop divides 40 times: a few ulps more than torch's on the weights.
GPU_F32_W = dict(rtol=5e-5, atol=5e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_gpu_v4_flash_sizes(tokens):
    _check_all(tokens, V4_FLASH["hc"], V4_FLASH["dim"], V4_FLASH["iters"], torch.bfloat16,
               tokens, "cuda", GPU_BF16, GPU_F32_W)  # fmt: skip


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    """One hyper-connection, the block's expansion and the head captured in a
    CUDA graph: each replay reads the inputs' new contents and writes what the
    eager launches write, bit for bit."""
    hc, dim, iters, tokens = V4_FLASH["hc"], V4_FLASH["dim"], V4_FLASH["iters"], 8
    streams, fn, base, scale, out = _case(tokens, hc, dim, torch.bfloat16, 0, "cuda")
    _, h_fn, h_base, h_scale, _ = _case(tokens, hc, dim, torch.bfloat16, 1, "cuda", True)
    mixes, h_mixes = _mixes(streams, fn), _mixes(streams, h_fn)
    kw = dict(hc_eps=HC_EPS, norm_eps=NORM_EPS)

    def step():
        post, comb, collapsed = tri.mhc_pre(streams, mixes, base, scale, iters=iters, **kw)
        new = tri.mhc_post(streams, post, comb, out)
        return post, comb, collapsed, new, tri.mhc_head(new, h_mixes, h_base, h_scale, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        streams.copy_(2 * torch.randn(streams.shape, device="cuda", generator=g))
        out.copy_(2 * torch.randn(out.shape, device="cuda", generator=g))
        mixes.copy_(_mixes(streams, fn))
        h_mixes.copy_(torch.randn(h_mixes.shape, device="cuda", generator=g))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for c, e in zip(captured, eager, strict=True):
            assert torch.equal(c, e)
        _close(eager[2], ref.mhc_pre(streams, mixes, base, scale, iters=iters, **kw)[2], GPU_BF16)
