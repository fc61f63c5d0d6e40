"""Speculative decoding through the three services: the worker verifies over gRPC, outputs equal
the in-process engine's with speculation off, and the scheduler exports vLLM's spec-decode
counters."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from pagedserve.llm_engine import LLMEngine
from tests.e2e.stack import assert_idle
from tests.e2e.test_metrics import scrape, value
from tests.integration.test_spec_decode import prompts_with_repeats, run

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module")
def stack_config(stack_config):
    return dataclasses.replace(stack_config, scheduler=SchedulerConfig(
        speculative_config=json.dumps(NGRAM)))


@pytest.fixture(scope="module")
def stack_options():
    return {"metrics_port": 0}


def test_greedy_outputs_equal_the_engine_without_speculation(stack, generation,
                                                             tiny_served_model_dir):
    samples = assert_greedy_outputs_are_the_engines(stack, generation, tiny_served_model_dir)
    num_draft_tokens = value(samples, "vllm:spec_decode_num_draft_tokens_total")
    num_accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert value(samples, "vllm:spec_decode_num_drafts_total") > 0
    assert num_draft_tokens >= num_accepted
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == num_accepted


def assert_greedy_outputs_are_the_engines(stack, generation, model_dir) -> list:
    """Greedy outputs through the gateway equal the in-process engine's with speculation off;
    returns the scheduler's metric samples after them."""
    prompts = prompts_with_repeats(3)
    sampling = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    off = LLMEngine.from_kwargs(model=str(model_dir), device="cpu", num_threads=1)
    expected = run(off, prompts, sampling)
    for i, prompt in enumerate(prompts):
        response = generation.Generate(gateway_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(token_ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=32,
                                               ignore_eos=True)), timeout=60)
        assert list(response.outputs[0].token_ids) == expected[(i, 0)]
    assert_idle(stack)
    return scrape(stack, "scheduler")
