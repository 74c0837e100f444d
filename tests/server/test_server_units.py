"""Unit tests of the server's pure parts: settings from the environment,
presets, request parsing and Prometheus rendering. No model, no process."""

from __future__ import annotations

import json

import pytest

from tinyengine.models_presets import PresetError, resolve_model, served_model_name
from tinyengine.serve.metrics import ServerMetrics
from tinyengine.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from tinyengine.serve.settings import DEFAULT_MAX_REQUEST_BYTES, ServerSettings, parse_option
from tinyengine.serve.tokenize import template_messages


def test_settings_from_env_parse_every_kind_of_field():
    env = {
        "TINYENGINE_MODEL": "smollm2-135m",
        "TINYENGINE_MAX_NUM_SEQS": "8",
        "TINYENGINE_GPU_MEMORY_UTILIZATION": "0.5",
        "TINYENGINE_ENFORCE_EAGER": "true",
        "TINYENGINE_ENABLE_PREFIX_CACHING": "0",
        "TINYENGINE_HF_OVERRIDES": '{"num_hidden_layers": 2}',
        "TINYENGINE_CUDA_GRAPH_SIZES": "[1, 2, 4]",
        "TINYENGINE_MAX_MODEL_LEN": "none",
        "TINYENGINE_API_KEY": "secret",
        "TINYENGINE_MAX_REQUEST_BYTES": "1000",
        "TINYENGINE_MAX_N": "4",
        "TINYENGINE_MAX_REQUEST_SEQUENCES": "64",
        "TINYENGINE_CACHE": "/not/an/engine/option",  # other TINYENGINE_ vars are left alone
    }
    s = ServerSettings.from_env(env)
    assert s.model == "smollm2-135m" and s.model_name == "smollm2-135m"
    assert s.engine_kwargs == {
        "max_num_seqs": 8,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "hf_overrides": {"num_hidden_layers": 2},
        "cuda_graph_sizes": [1, 2, 4],
        "max_model_len": None,
    }
    assert s.api_key == "secret" and s.max_request_bytes == 1000
    assert s.max_n == 4 and s.max_request_sequences == 64
    default = ServerSettings.from_env({})
    assert default.model == "deepseek-v4-tiny" and default.model_name == "deepseek-v4-tiny"
    assert default.api_key is None and default.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert default.max_n == 128 and default.max_request_sequences == 4096


@pytest.mark.parametrize(
    "env,words",
    [
        ({"TINYENGINE_MAX_NUM_SEQS": "many"}, "TINYENGINE_MAX_NUM_SEQS='many'"),
        ({"TINYENGINE_ENFORCE_EAGER": "maybe"}, "TINYENGINE_ENFORCE_EAGER"),
        ({"TINYENGINE_HF_OVERRIDES": "[1]"}, "JSON dict"),
        ({"TINYENGINE_DTYPE": "float8"}, "EngineConfig.dtype"),
        ({"TINYENGINE_MAX_N": "0"}, "max_n must be >= 1"),
        ({"TINYENGINE_MAX_REQUEST_SEQUENCES": "lots"}, "TINYENGINE_MAX_REQUEST_SEQUENCES"),
    ],
)
def test_bad_settings_fail_at_startup_naming_the_variable(env, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        ServerSettings.from_env(env)


def test_unknown_variables_are_named_in_a_warning(caplog):
    env = {"TINYENGINE_KV_CACHE_DTYPE": "fp8", "TINYENGINE_MAX_NUM_SEQ": "8",
           "TINYENGINE_MAX_NUM_SEQS": "8", "TINYENGINE_CACHE": "/tmp/x"}  # fmt: skip
    with caplog.at_level("WARNING", logger="tinyengine.server"):
        settings = ServerSettings.from_env(env)
    assert settings.engine_kwargs == {"max_num_seqs": 8}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "TINYENGINE_KV_CACHE_DTYPE" in warned and "TINYENGINE_MAX_NUM_SEQ " in warned
    assert "TINYENGINE_CACHE" not in warned and "MAX_NUM_SEQS" not in warned


def test_engine_config_checks_bools_and_seed():
    from tinyengine.config import EngineConfig

    for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling"):
        with pytest.raises(ValueError, match=f"EngineConfig.{name} must be True or False"):
            EngineConfig.from_kwargs("m", **{name: "false"})
    with pytest.raises(ValueError, match="EngineConfig.seed"):
        EngineConfig.from_kwargs("m", seed="abc")
    assert EngineConfig.from_kwargs("m", seed=None).seed is None  # vLLM's: a random seed


def test_parse_option_optional_int():
    assert parse_option("X", "None", int | None) is None
    assert parse_option("X", " 12 ", int | None) == 12


def test_presets(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a folder is used as is
    assert served_model_name(str(tmp_path / "my-model") + "/") == "my-model"
    assert served_model_name(None) == "deepseek-v4-tiny"
    with pytest.raises(PresetError, match="neither an existing folder nor a preset"):
        resolve_model("no-such-model")


def test_request_parsing():
    r = parse_request(b'{"prompt": [[1, 2], [3]], "stop": "x", "max_tokens": 3}', CompletionRequest)
    assert r.prompts() == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert r.sampling_params().stop == ["x"]
    chat = parse_request(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "logprobs": true, "top_logprobs": 2,'
        b' "max_completion_tokens": 7}',
        ChatCompletionRequest,
    )
    assert template_messages(chat.messages) == [{"role": "user", "content": "ab"}]
    params = chat.sampling_params()
    assert params.logprobs == 2 and params.max_tokens == 7
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    chat_body = {"messages": [{"role": "user", "content": "a"}], "tools": [tool]}
    with pytest.raises(APIError) as e:  # tool_choice defaults to "auto": no parser
        parse_request(json.dumps(chat_body).encode(), ChatCompletionRequest)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    chat_body["tool_choice"] = "none"  # rendered into the prompt only
    assert parse_request(json.dumps(chat_body).encode(), ChatCompletionRequest).tools == [tool]
    for body, param in [
        (b'{"prompt": "a", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": "a", "presence_penalty": 2.5}', "presence_penalty"),
        (b'{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
        (b'{"prompt": "a", "n": 2, "best_of": 4}', "best_of"),
        (b'{"prompt": "a", "response_format": {"type": "json_object"}}', "response_format"),
        (b'{"prompt": "a", "top_p": 0}', "top_p"),
        (b'{"prompt": "a", "stream": 1}', "stream"),
        (b'{"prompt": "a", "min_tokens": 5, "max_tokens": 2}', "min_tokens"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": [[]]}', "prompt"),
    ]:
        with pytest.raises(APIError) as e:
            request = parse_request(body, CompletionRequest)
            request.sampling_params()
            request.prompts()
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


def test_metrics_render():
    m = ServerMetrics()
    m.record_first_token(0.05)
    m.record_finished("stop", 10, 5, 1.0, 0.4)
    m.count_request("rejected")
    text = m.render(
        {
            "num_total_blocks": 10,
            "num_free_blocks": 7,
            "num_running": 1,
            "num_waiting": 2,
            "prefix_cache_hit_tokens": 16,
            "prefix_cache_query_tokens": 64,
            "num_preemptions": 3,
            "batch_invariant": True,
        },
        {"load": 1.5},
        True,
        'we"ird',
    )
    lines = text.splitlines()
    assert 'tinyengine_requests_total{status="stop"} 1' in lines
    assert 'tinyengine_requests_total{status="rejected"} 1' in lines
    assert "tinyengine_kv_blocks_used 3" in lines
    assert "tinyengine_prefix_cache_hit_rate 0.25" in lines
    assert "tinyengine_num_preemptions_total 3" in lines
    assert "tinyengine_batch_invariant 1" in lines
    assert 'tinyengine_time_per_output_token_seconds_bucket{le="0.1"} 1' in lines
    assert 'tinyengine_startup_stage_seconds{stage="load"} 1.5' in lines
    assert 'tinyengine_model_info{model="we\\"ird"} 1' in lines


def test_serve_takes_the_model_positionally_as_vllm_serve_does():
    from tinyengine.__main__ import build_parser

    args = build_parser().parse_args(["serve", "smollm2-135m", "--port", "9"])
    assert (args.model_tag, args.model, args.port) == ("smollm2-135m", None, 9)
    args = build_parser().parse_args(["serve", "--model", "smollm2-135m"])
    assert (args.model_tag, args.model) == (None, "smollm2-135m")


def test_async_engine_implements_the_engine_client():
    """Every member of EngineClient (the handlers' whole view of the engine)
    exists on AsyncLLMEngine with the same kind and parameters."""
    import inspect

    from tinyengine.serve.async_engine import AsyncLLMEngine
    from tinyengine.serve.engine_client import EngineClient

    members = [n for n in vars(EngineClient) if not n.startswith("_")]
    assert {"model_info", "tokenizer", "submit", "abort", "health", "stats"} <= set(members)
    for name in members:
        spec = inspect.getattr_static(EngineClient, name)
        impl = inspect.getattr_static(AsyncLLMEngine, name, None)
        if isinstance(spec, property):
            # a property on the class, or (metrics) an attribute set in __init__
            assert isinstance(impl, property) or (
                impl is None and name in AsyncLLMEngine.__init__.__code__.co_names
            ), name
        else:
            assert callable(impl), name
            assert list(inspect.signature(impl).parameters) == list(
                inspect.signature(spec).parameters
            ), name


def test_handlers_never_reach_through_the_bridge():
    """Only async_engine.py knows the engine: no other serve/ file imports
    the engine's modules or reads an `engine` / `_engine` attribute (other
    than `app.state.engine`, where the app keeps its EngineClient)."""
    import ast
    from pathlib import Path

    serve = Path(__file__).resolve().parents[2] / "tinyengine" / "serve"
    engine_modules = ("tinyengine.engine", "tinyengine.llm", "tinyengine.worker",
                      "tinyengine.scheduling")  # fmt: skip
    wrong = []
    for path in sorted(serve.glob("*.py")):
        if path.name == "async_engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(engine_modules):
                wrong.append(f"{path.name}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.Import):
                wrong += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith(engine_modules)]  # fmt: skip
            if isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine"):
                on_state = isinstance(node.value, ast.Attribute) and node.value.attr == "state"
                if not on_state:
                    wrong.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_cli_flags_set_the_fan_out_caps(monkeypatch):
    import argparse

    from tinyengine.serve.cli import add_serve_parser, settings_from_args

    monkeypatch.setenv("TINYENGINE_MAX_N", "16")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--max-request-sequences", "100"])
    s = settings_from_args(args)
    assert s.max_n == 16 and s.max_request_sequences == 100  # the flag over the environment
    args = parser.parse_args(["serve", "--max-n", "2"])
    assert settings_from_args(args).max_n == 2
