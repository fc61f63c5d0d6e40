"""Speculative decoding with a draft model, end to end through LLMEngine: outputs token for token
those of speculation off while the draft model's KV follows its sequences through chunked
prefill, preemption by recompute and by swap, prefix caching and n > 1."""

from __future__ import annotations

import json

import pytest
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.sampling_params import SamplingParams

from bench.draft_model import truncate
from pagedserve.llm_engine import LLMEngine
from tests.integration.test_spec_decode import TINY, prompts_with_repeats, run, speculator


def draft_config(path, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
                       "adaptive": False})


@pytest.fixture(scope="module")
def off(llama_dir):
    return LLMEngine.from_kwargs(model=str(llama_dir), **TINY)


@pytest.fixture(scope="module")
def truncated_draft(llama_dir, tmp_path_factory):
    """The tiny Llama's first layer: it proposes some of the target's tokens, not all."""
    return truncate(llama_dir, tmp_path_factory.mktemp("draft"), num_layers=1)


def under_pressure(llama_dir, draft, preemption_mode: str) -> LLMEngine:
    """Few blocks (preemption), chunked prefill in 32-token steps, prefix caching."""
    return LLMEngine.from_kwargs(
        model=str(llama_dir), speculative_config=draft_config(draft),
        num_gpu_blocks_override=40, num_cpu_blocks_override=64, enable_prefix_caching=True,
        max_num_batched_tokens=32, preemption_mode=preemption_mode, **TINY)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_outputs_equal_speculation_off(off, llama_dir, truncated_draft, preemption_mode):
    on = under_pressure(llama_dir, truncated_draft, preemption_mode)
    prompts = prompts_with_repeats(6)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert run(on, prompts, sampling) == run(off, prompts, sampling)
    totals = speculator(on).totals
    assert totals.num_draft_tokens > totals.num_accepted_tokens > 0
    assert on.core.scheduler.num_preemptions > 0


def test_a_draft_model_equal_to_the_target_proposes_its_tokens(off, llama_dir):
    """Nearly every draft is kept only if the draft model's KV is right at every position:
    prompts in chunks, a recomputed prompt, the last accepted draft, rejected drafts' slots."""
    on = under_pressure(llama_dir, llama_dir, "recompute")
    prompts = prompts_with_repeats(6)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert run(on, prompts, sampling) == run(off, prompts, sampling)
    totals = speculator(on).totals
    assert totals.num_accepted_tokens >= 0.95 * totals.num_draft_tokens > 0
    assert on.core.scheduler.num_preemptions > 0


def test_seeded_sampling_and_n_greater_than_one_equal_speculation_off(off, llama_dir,
                                                                      truncated_draft):
    on = under_pressure(llama_dir, truncated_draft, "swap")
    prompts = prompts_with_repeats(3)
    for sampling in (SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24,
                                    ignore_eos=True),
                     SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24,
                                    ignore_eos=True)):
        assert run(on, prompts, sampling) == run(off, prompts, sampling)
    assert speculator(on).totals.num_draft_tokens > 0


def test_a_draft_model_whose_kv_does_not_fit_the_targets_blocks_is_refused(llama_dir,
                                                                          tiny_model_dir):
    with pytest.raises(ConfigError, match=r"speculative_config.model=.*num_kv_heads, head_size"):
        LLMEngine.from_kwargs(model=str(tiny_model_dir("opt")),
                              speculative_config=draft_config(llama_dir), **TINY)
