"""Piecewise graphs (worker/piecewise_graphs.py) on CPU, with the recording
backend: its replay re-runs the forward on the *capture's* context (the host
values a real graph bakes in) and hands only the splitting ops the live one,
so model code that reads a step's metadata outside a splitting op computes
wrong tokens here as it would on a GPU.

- the backend itself: a toy step that reads metadata outside its splitting
  op gives wrong rows on replay, one that keeps to the contract does not;
  padding rows never reach a real row; a moved workspace is caught;
- the engine: prefill, chunked and mixed steps of Llama, Qwen3, DeepSeek-V3
  and DeepSeek-V4 tiny models replay piecewise graphs and generate the eager
  engine's tokens (with prefix hits and preemption), and the same comparison
  fails for a model whose attention ignores the live context;
- startup: the report and stats list the token counts; steps past the
  largest run eagerly; bad settings are clear errors.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.hf_deepseek import make_tiny_deepseek
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels import choose_ops
from tinyengine.kernels.workspace import Workspace
from tinyengine.models.context import AttentionMetadata, ForwardContext
from tinyengine.models.layers import PagedAttention
from tinyengine.worker.cuda_graphs import StaleGraphAddressError
from tinyengine.worker.piecewise_graphs import PiecewiseGraphs, RecordingPiecewiseBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PIECEWISE = dict(graph_backend="recording", cudagraph_mode="full_and_piecewise")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# --------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------


def _ctx(num_seqs: int, num_tokens: int, workspace: Workspace) -> ForwardContext:
    empty = torch.zeros(0, dtype=torch.int32)
    attn = AttentionMetadata(num_tokens, num_seqs, 1, 1, empty, empty, empty, empty)
    return ForwardContext(attn, [None], choose_ops("torch", "cpu"), workspace)  # one layer


def _scale_by_seqs(ctx: ForwardContext, rows: torch.Tensor) -> torch.Tensor:
    return rows * ctx.attn.num_seqs


def _toy(x: torch.Tensor, ctx: ForwardContext, outside: bool):
    """x * 2 -> splitting op (x num_seqs) -> + 1; `outside` also multiplies
    by num_seqs after it, breaking the contract."""

    def step() -> torch.Tensor:
        out = ctx.splitting_op(_scale_by_seqs, x * 2) + 1
        return out * ctx.attn.num_seqs if outside else out

    return step


@pytest.mark.parametrize("outside", [False, True], ids=["contract", "reads-outside"])
def test_replay_bakes_in_what_is_read_outside_the_splitting_ops(outside):
    ws = Workspace(torch.device("cpu"))
    ws.get(((64,), torch.uint8))
    x = torch.arange(8, dtype=torch.float32)
    capture_ctx = _ctx(num_seqs=1, num_tokens=8, workspace=ws)
    graphs = PiecewiseGraphs(RecordingPiecewiseBackend(ws))
    graphs.capture(8, capture_ctx, _toy(x, capture_ctx, outside))
    assert graphs.padded_size(5) == 8 and graphs.padded_size(9) is None

    x.copy_(torch.arange(8, dtype=torch.float32) + 100)  # the live step's inputs
    live = _ctx(num_seqs=3, num_tokens=5, workspace=ws)
    replayed = graphs.replay(8, live, num_tokens=5)
    eager = _toy(x[:5], live, outside)()
    assert torch.equal(replayed[:5], eager) != outside
    # Padding rows carry what the capture computed there, never the live values.
    assert torch.equal(replayed[5:], (torch.arange(5, 8) * 2 * 1 + 1).float())
    assert graphs.backend.num_replays == 1


def test_a_moved_workspace_is_a_stale_address():
    ws = Workspace(torch.device("cpu"))
    ws.get(((64,), torch.uint8))
    ctx = _ctx(1, 4, ws)
    graphs = PiecewiseGraphs(RecordingPiecewiseBackend(ws))
    graphs.capture(4, ctx, _toy(torch.ones(4), ctx, False))
    ws.get(((ws.size + 1,), torch.uint8))  # grows: the arena moves
    with pytest.raises(StaleGraphAddressError, match="piecewise graph"):
        graphs.replay(4, _ctx(1, 4, ws), 4)


def test_every_token_count_shares_the_largest_counts_buffers():
    ws = Workspace(torch.device("cpu"))
    ws.get(((64,), torch.uint8))
    graphs = PiecewiseGraphs(RecordingPiecewiseBackend(ws))
    x = torch.arange(8, dtype=torch.float32)
    for size in (8, 4):
        ctx = _ctx(1, size, ws)
        graphs.capture(size, ctx, _toy(x[:size], ctx, False))
    large, small = graphs.captured[8].calls[0], graphs.captured[4].calls[0]
    assert small.rows[0].data_ptr() == large.rows[0].data_ptr()
    assert small.output.data_ptr() == large.output.data_ptr()
    # Replays of either size compute their own rows through the shared buffers.
    x.copy_(torch.arange(8, dtype=torch.float32) + 10)
    for size, n in ((4, 3), (8, 6), (4, 4)):
        live = _ctx(2, n, ws)
        assert torch.equal(graphs.replay(size, live, n)[:n], _toy(x[:n], live, False)())


def test_a_smaller_count_captured_first_is_a_clear_error():
    ws = Workspace(torch.device("cpu"))
    ws.get(((64,), torch.uint8))
    graphs = PiecewiseGraphs(RecordingPiecewiseBackend(ws))
    x = torch.arange(8, dtype=torch.float32)
    small = _ctx(1, 4, ws)
    graphs.capture(4, small, _toy(x[:4], small, False))
    ctx = _ctx(1, 8, ws)
    with pytest.raises(RuntimeError, match="capture the largest token count first"):
        graphs.capture(8, ctx, _toy(x, ctx, False))


# --------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(32)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 13, 29, 47)]
    return prompts + [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (2, 11)]


PROMPTS = [{"prompt_token_ids": p} for p in _prompts()]


def _model(kind: str, root) -> str:
    if kind == "deepseek-v3":
        return str(make_tiny_deepseek("v3", root))
    if kind == "deepseek-v4":
        return str(make_tiny_v4(root))
    return str(make_tiny_hf_model(kind, root, num_hidden_layers=2))


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek-v3", "deepseek-v4"])
def model(request, tmp_path_factory) -> str:
    return _model(request.param, tmp_path_factory.mktemp(request.param))


def _generate(path: str, **config) -> tuple[LLM, list[list[int]]]:
    base = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=48,
                print_startup_report=False, cuda_graph_sizes=[1, 2])  # fmt: skip
    llm = LLM(path, **{**base, **config})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_piecewise_replays_generate_the_eager_tokens(model):
    """Chunked prefills (48-token budget), mixed prefill + decode steps,
    decode batches larger than the decode graphs, and prefix hits on the
    shared 32-token prefix all replay piecewise graphs."""
    _, eager = _generate(model, graph_backend="none")
    llm, tokens = _generate(model, **PIECEWISE)
    runner = llm.engine.runner
    assert runner.piecewise.backend.num_replays >= 5
    assert tokens == eager
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_piecewise_under_preemption_keeps_the_eager_tokens(tmp_path):
    path = _model("llama", tmp_path)
    tight = dict(num_kv_blocks=8, block_size=16)  # not every sequence fits at once
    _, eager = _generate(path, graph_backend="none", **tight)
    llm, tokens = _generate(path, **PIECEWISE, **tight)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert tokens == eager


def test_piecewise_logprobs_and_prompt_logprobs_match_eager(tmp_path):
    """Hidden rows past the real tokens are padding: the sampled rows and the
    prompt positions read only real ones."""
    path = _model("qwen3", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    outs = {}
    for name, config in (("eager", {"graph_backend": "none"}), ("piecewise", PIECEWISE)):
        llm, _ = _generate(path, **config)
        outs[name] = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for got, want in zip(outs["piecewise"], outs["eager"], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        pairs = list(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True))
        pairs += list(zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True))
        for a, b in pairs:
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-5


def test_an_attention_that_ignores_the_live_context_is_caught(tmp_path, monkeypatch):
    """Break the contract: the splitting op attends with the context its
    layer closed over (at replay: the capture's dummy step). The tokens
    must change, or the comparison above could not fail. (The torch
    reference may also notice that the rows it is handed do not match that
    metadata and fail the step: caught either way.)"""
    path = _model("llama", tmp_path)
    _, eager = _generate(path, graph_backend="none")
    attend = PagedAttention._attend

    def forward_rope(self, q, k, v, positions, cos_sin_cache, ctx, q_norm=None, k_norm=None):
        k_cache, v_cache = self._kv_cache(ctx)
        q = ctx.ops.rope_write_kv(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, ctx.attn.slot_mapping,
            q_norm.weight if q_norm else None, k_norm.weight if k_norm else None,
            q_norm.eps if q_norm else 1e-6,
        )  # fmt: skip
        return ctx.splitting_op(lambda _live, rows: attend(self, ctx, rows), q)

    monkeypatch.setattr(PagedAttention, "forward_rope", forward_rope)
    try:
        _, tokens = _generate(path, **PIECEWISE)
    except RuntimeError as exc:
        assert "paged_attention" in str(exc) or "size of tensor" in str(exc), exc
    else:
        assert tokens != eager


def test_an_attention_that_bypasses_the_splitting_op_fails_startup(tmp_path, monkeypatch):
    """Its graph would bake the dummy step's lengths into attention."""
    path = _model("llama", tmp_path)

    def forward_rope(self, q, k, v, positions, cos_sin_cache, ctx, q_norm=None, k_norm=None):
        k_cache, v_cache = self._kv_cache(ctx)
        ctx.ops.write_kv_cache(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        return self._attend(ctx, q)

    monkeypatch.setattr(PagedAttention, "forward_rope", forward_rope)
    with pytest.raises(RuntimeError, match="met 0 splitting ops for 2 attention layers"):
        _generate(path, **PIECEWISE)


# --------------------------------------------------------------------------
# startup and settings
# --------------------------------------------------------------------------


def test_report_lists_both_kinds_and_large_steps_run_eagerly(tmp_path):
    path = _model("llama", tmp_path)
    llm, _ = _generate(path, **PIECEWISE, piecewise_graph_sizes=[16, 8, 100])
    report = llm.startup_report()
    # 100 is past max_num_batched_tokens (48): a step never has that many tokens.
    assert report.piecewise_sizes == [8, 16] and report.captured_sizes == [1, 2]
    assert llm.stats()["piecewise_graph_sizes"] == [8, 16]
    assert report.workspace_growth_after_kv_sizing == 0 and llm.engine.runner.workspace.locked
    runner = llm.engine.runner
    replays = runner.piecewise.backend.num_replays
    # One 40-token prompt: its prefill is past 16 tokens (eager), then its
    # decode steps replay the size-1 decode graph.
    decode_before = runner.graphs.backend.num_replays
    llm.generate([{"prompt_token_ids": list(range(3, 43))}], GREEDY, use_tqdm=False)
    assert runner.piecewise.backend.num_replays == replays
    assert runner.graphs.backend.num_replays == decode_before + GREEDY.max_tokens - 1


def test_piecewise_graphs_are_the_default_and_full_decode_only_turns_them_off(tmp_path):
    path = _model("llama", tmp_path)
    llm, _ = _generate(path, graph_backend="recording")
    assert llm.startup_report().piecewise_sizes and llm.engine.runner.piecewise is not None
    llm, _ = _generate(path, graph_backend="recording", cudagraph_mode="full_decode_only")
    assert llm.startup_report().piecewise_sizes == [] and llm.engine.runner.piecewise is None


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"cudagraph_mode": "piecewise"}, "cudagraph_mode must be one of"),
        ({"piecewise_graph_sizes": []}, "piecewise_graph_sizes must be a non-empty list"),
        ({"piecewise_graph_sizes": [8, 0]}, "piecewise_graph_sizes must be a non-empty list"),
    ],
)
def test_bad_piecewise_settings_are_clear_errors(setting, message):
    with pytest.raises(ValueError, match=message):
        LLM("unused-model-name", **setting)


def test_the_default_ladder_reaches_2048_tokens_with_bounded_padding():
    """The default token counts cover a serving step of one long prompt plus
    the running decodes (up to 2,048 tokens), and padding a step to the next
    count never doubles it (past 512, adds at most a third)."""
    from tinyengine.worker.piecewise_graphs import default_piecewise_sizes

    sizes = default_piecewise_sizes(8192)
    assert sizes[0] == 8 and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    for low, high in zip(sizes, sizes[1:], strict=False):
        assert high <= 2 * low and (low < 512 or high - low <= 256), (low, high)
    assert default_piecewise_sizes(1000) == [s for s in sizes if s <= 1000]
    assert default_piecewise_sizes(1000)[-1] == 768
