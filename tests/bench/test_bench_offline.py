"""CPU smoke runs of the offline benchmarks (throughput, latency, startup) on
the deepseek-v3-tiny preset, invoked as a user would, with a few requests of
tiny lengths, so the tools never rot. Figures are checked for sense (counts
equal to what was asked, positive times and ratios), never for speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinyengine.bench.__main__ import main as bench_main
from tinyengine.bench.common import BenchError, engine_supports
from tinyengine.bench.prompts import TokenPool
from tinyengine.bench.throughput import Workload, run_engine

REPO = Path(__file__).resolve().parents[2]
MODEL = "deepseek-v3-tiny"
# Small engine limits: startup profiles the worst step, so they keep it quick.
ENGINE = ["--model", MODEL, "--max-num-seqs", "4", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def tiny_folder() -> str:
    """The preset's folder, built into the tinyengine cache once."""
    from tinyengine.models_presets import resolve_model

    return resolve_model(MODEL)


def test_throughput_as_a_user_runs_it(tiny_folder: str, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    cmd = [
        sys.executable, "-m", "tinyengine.bench", "throughput", *ENGINE,
        "--num-prompts", "4", "--input-len-range", "8:16", "--output-len-range", "8:16",
        "--compare", "hf", "--profile-host", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Output tokens/s" in proc.stdout and "tinyengine / HF" in proc.stdout

    data = json.loads(out.read_text())
    asked = data["max_tokens"]
    assert len(asked) == 4 and all(8 <= n <= 16 for n in asked)
    assert all(8 <= n <= 16 for n in data["prompt_lens"])
    engine = data["engine"]
    assert engine["output_lens"] == asked  # ignore_eos: exactly what was asked
    assert engine["output_tokens"] == sum(asked)
    assert engine["elapsed_s"] > 0 and engine["output_tokens_per_s"] > 0
    assert engine["total_tokens_per_s"] > engine["output_tokens_per_s"]
    hf = data["hf"]
    assert hf["output_tokens"] == sum(asked)  # only requested tokens are credited
    assert hf["wasted_output_tokens"] == 4 * max(asked) - sum(asked)
    assert hf["elapsed_s"] > 0 and data["speedup_vs_hf"] > 0
    if engine_supports("profile_steps"):
        assert data["step_profile"]
        # Decode steps against their roofline: contexts of 8..16-token prompts
        # plus up to 16 outputs, so every row attends over 9..32 tokens.
        roof = data["decode_roofline"]
        assert 9 <= roof["mean_context"] <= 32 and 1 <= roof["batch"] <= 4
        assert roof["step_s"] > 0 and roof["wall_over_roofline"] > 0
        assert roof["kv_bytes"] > 0 and roof["weight_bytes"] > 0
        assert "Roofline step (ms)" in proc.stdout


def test_latency_with_hf_and_plot(tiny_folder: str, tmp_path: Path) -> None:
    out, png = tmp_path / "latency.json", tmp_path / "decode.png"
    rc = bench_main(
        [
            "latency", *ENGINE, "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "6",
            "--num-iters", "2", "--num-iters-warmup", "1", "--compare", "hf",
            "--bandwidth-gib", "0.03", "--plot", str(png), "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads(out.read_text())
    assert data["bandwidth"]["bytes_per_s"] > 0
    assert data["kv_bytes_per_token"] == (32 + 8) * 2 * 4  # MLA latent, 2 layers, fp32
    assert data["mean_decode_context"] == 8 + 6 / 2
    assert [r["batch_size"] for r in data["runs"]] == [1, 2]
    for run in data["runs"]:
        assert run["num_decode_steps"] == 2 * (6 - 1)  # iterations x (O - 1)
        assert run["prefill_ms"] > 0 and run["decode_step_ms"]["mean"] > 0
        step = run["decode_step_ms"]
        assert step["p50"] <= step["p99"]
        assert run["decode_tokens_per_s"] > 0
        assert run["roofline"]["weight_bytes"] > 0 and run["roofline"]["kv_bytes"] > 0
        assert run["roofline"]["step_s"] > 0
        assert 0 < run["roofline_fraction"]
        assert run["hf"]["decode_step_ms"] > 0 and run["speedup_vs_hf"] > 0
    # MoE: the experts a batch touches come from the model's recorded routing
    # (one MoE layer of 8 experts, top-2): exactly 2 for one token, 2..4 for two.
    assert data["expert_routing"] == "measured"
    one, two = (run["experts_touched"] for run in data["runs"])
    assert one["measured"] == [2.0] and one["uniform"] == [pytest.approx(2.0)]
    assert 2.0 <= two["measured"][0] <= 4.0
    curve = data["roofline_curve"]
    assert curve[0][0] == 1 and curve[-1][0] == 2 and all(t > 0 for _, t in curve)


def test_startup_report(tiny_folder: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "startup.json"
    assert bench_main(["startup", *ENGINE, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "capture" in printed and "LLM(...) wall time" in printed

    data = json.loads(out.read_text())
    report = data["report"]
    assert report["state"] == "ready"
    names = [s["name"] for s in report["stages"]]
    assert names == ["load", "profile", "size_kv", "warmup", "capture", "lock"]
    assert data["wall_s"] >= data["stages_s"] > 0
    assert report["num_kv_blocks"] > 0 and data["kv_cache_bytes"] > 0
    # The torch op set on the CPU compiles no Triton kernel; the totals are
    # the stages' own figures summed.
    assert "Triton kernel variants" in printed
    assert data["triton_kernels"] == sum(s["kernels"] for s in report["stages"]) == 0
    assert data["triton_compile_s"] == sum(s["compile_seconds"] for s in report["stages"])


def test_wrong_output_length_fails_loudly() -> None:
    """A request that returns fewer tokens than asked must fail the run."""

    def generate(prompts, params, use_tqdm):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2])]) for _ in prompts]

    llm = SimpleNamespace(
        generate=generate,
        engine=SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cpu"))),
    )
    with pytest.raises(BenchError, match="1 of 2 outputs have the wrong length"):
        run_engine(llm, Workload([[5, 6], [7, 8]], [2, 3]), temperature=0.0)


def test_token_pool_avoids_special_tokens(tiny_folder: str) -> None:
    import numpy as np

    pool = TokenPool(tiny_folder, 129280)
    # DeepSeek-V3's tokenizer: ids 0-2 and everything from 128000 are special.
    assert pool.ids.min() == 3 and pool.ids.max() < 128000
    ids = pool.sample(np.random.default_rng(0), 1000)
    assert len(ids) == 1000 and all(3 <= t < 128000 for t in ids)
