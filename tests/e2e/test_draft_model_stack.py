"""Speculative decoding with a draft model through the three services: the worker loads the
draft, proposes and verifies inside its steps over gRPC, and the gateway's greedy outputs equal
the in-process engine's with speculation off."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pagedserve.services.common.config import SchedulerConfig

from bench.draft_model import truncate
from tests.e2e.test_metrics import value
from tests.e2e.test_spec_decode_stack import assert_greedy_outputs_are_the_engines


@pytest.fixture(scope="module")
def stack_config(stack_config, tiny_served_model_dir, tmp_path_factory):
    """The draft: the target's first layer, which proposes some of its tokens and not others."""
    draft = truncate(tiny_served_model_dir, tmp_path_factory.mktemp("draft"), num_layers=1)
    return dataclasses.replace(stack_config, scheduler=SchedulerConfig(
        speculative_config=json.dumps({"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": 3, "adaptive": False})))


@pytest.fixture(scope="module")
def stack_options():
    return {"metrics_port": 0}


def test_greedy_outputs_equal_the_engine_without_speculation(stack, generation,
                                                             tiny_served_model_dir):
    samples = assert_greedy_outputs_are_the_engines(stack, generation, tiny_served_model_dir)
    num_draft_tokens = value(samples, "vllm:spec_decode_num_draft_tokens_total")
    num_accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert num_draft_tokens > num_accepted > 0  # drafts kept and rejected both went through
