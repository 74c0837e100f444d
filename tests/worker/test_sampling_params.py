"""SamplingParams validation (tinyengine/sampling_params.py), the sampler's
user-facing inputs: bad values rejected with the field named, edge values
accepted, and n > 1 fanned out into one-sequence requests with seed + i."""

from __future__ import annotations

import math

import pytest

from tinyengine.sampling_params import MAX_LOGPROBS, SamplingParams

# ------------------------------------------------------------------ SamplingParams validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**63}, "seed"),  # torch's generator would overflow mid-step
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(top_k=0, min_p=1.0, logprobs=0, max_tokens=None, min_tokens=100)
    SamplingParams(logprobs=MAX_LOGPROBS, stop="x", min_tokens=3, max_tokens=3)
    last = SamplingParams(seed=2**63 - 1, n=3).fan_out()  # seed + i wraps within int64
    assert [p.seed for p in last] == [2**63 - 1, -(2**63), -(2**63) + 1]
    SamplingParams(seed=-(2**63))
    assert math.isclose(SamplingParams(temperature=0.5).temperature, 0.5)


def test_n_fans_out_into_one_sequence_requests():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.n"):
            SamplingParams(n=bad)
    one = SamplingParams(n=1, seed=5)
    assert one.fan_out() == [one]
    kids = SamplingParams(n=3, seed=5, temperature=0.7, max_tokens=4).fan_out()
    assert [(k.n, k.seed, k.temperature, k.max_tokens) for k in kids] == [
        (1, 5, 0.7, 4), (1, 6, 0.7, 4), (1, 7, 0.7, 4)
    ]  # fmt: skip
    assert [k.seed for k in SamplingParams(n=2).fan_out()] == [None, None]
