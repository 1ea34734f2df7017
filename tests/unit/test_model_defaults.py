"""The model's own sampling defaults (issue 47 item 4): what generation_config.json declares, and how a request's
fields, those defaults and the API's defaults combine (models.loading.generation_defaults, server.core.prompts)."""

from __future__ import annotations

import json

import pytest

from models.loading.generation_defaults import NO_DEFAULTS, SamplingDefaults, read_sampling_defaults
from server.core.prompts import sampling_params
from server.core.request import GenerationRequest

QWEN3 = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.mark.parametrize("config, expected", [
    ({"bos_token_id": 1, "eos_token_id": [2, 0]}, NO_DEFAULTS),  # the default model's: declares no sampling
    (QWEN3, SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.8}, SamplingDefaults(temperature=0.0, top_p=0.8)),
    ({"repetition_penalty": 1.05, "min_p": 0.05}, SamplingDefaults(min_p=0.05, repetition_penalty=1.05)),
    ({"temperature": "hot", "top_k": 2.5, "top_p": 0, "repetition_penalty": -1}, NO_DEFAULTS),  # ignored, logged
    ({"temperature": None, "top_k": True}, NO_DEFAULTS),
])
def test_what_generation_config_declares(tmp_path, config, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == expected


def test_no_file_or_a_broken_one_declares_nothing(tmp_path):
    assert read_sampling_defaults(tmp_path) is NO_DEFAULTS
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) is NO_DEFAULTS


def params(defaults=NO_DEFAULTS, **fields):
    req = GenerationRequest(messages=({"role": "user", "content": "hi"},), **fields)
    return sampling_params(req, 5, 100, default_max_tokens=8, vocab_size=1000, defaults=defaults)


@pytest.mark.parametrize("fields, expected", [
    ({}, (0.6, 0.95, 20, 0.0, None)),  # the model's
    ({"temperature": 0}, (0.0, 0.95, 20, 0.0, None)),  # the request's wins, field by field
    ({"top_p": 1.0, "top_k": 0}, (0.6, 1.0, 0, 0.0, None)),
    ({"top_p": 0.0}, (0.0, 1.0, 20, 0.0, None)),  # top_p 0: greedy
    ({"repetition_penalty": 1.2, "min_p": 0.1}, (0.6, 0.95, 20, 0.1, 1.2)),
])
def test_a_request_field_wins_over_the_models_default(fields, expected):
    p = params(SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20), **fields)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == expected


def test_without_model_defaults_the_apis_hold():
    p = params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, None)
    greedy = params(SamplingDefaults(temperature=0.0, repetition_penalty=1.0, top_k=5000))
    assert (greedy.temperature, greedy.repetition_penalty, greedy.top_k) == (0.0, None, 0)  # no-op values dropped
