"""EngineConfig.from_kwargs: the options a vLLM script passes to LLM(...)."""

from __future__ import annotations

import pytest

from tinyengine.config import EngineConfig


def test_vllm_options_run_unchanged_at_their_one_meaningful_value():
    config = EngineConfig.from_kwargs(
        "m", tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True,
        disable_log_stats=True, max_num_seqs=3,
    )  # fmt: skip
    assert config.model == "m" and config.max_num_seqs == 3


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size: tinyengine runs on one device"),
        ({"pipeline_parallel_size": 4}, "pipeline_parallel_size"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be True or False"),
    ],
)
def test_vllm_options_other_values_are_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs("m", **kwargs)


def test_unknown_options_are_named():
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['swap_spaces'\]"):
        EngineConfig.from_kwargs("m", swap_spaces=4)
