"""Speculative decoding with a draft model, end to end through LLMEngine: outputs token for token
those of speculation off while the draft model's KV follows its sequences through chunked
prefill, preemption by recompute and by swap, prefix caching and n > 1."""

from __future__ import annotations

import copy
import json

import pytest
from pagedserve.services.common.sampling_params import SamplingParams

from bench.draft_model import truncate
from pagedserve.llm_engine import LLMEngine
from tests.integration.test_spec_decode import TINY, prompts_with_repeats, run, speculator
from tests.tiny_models import load_hf


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


def test_seeded_sampling_and_n_greater_than_one_repeat_from_run_to_run(llama_dir,
                                                                       truncated_draft):
    """Sampled drafts go through rejection sampling: the tokens are the target distribution's,
    not speculation off's draws, and a seed gives the same ones in a fresh engine."""
    prompts = prompts_with_repeats(3)
    for sampling in (SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24,
                                    ignore_eos=True),
                     SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24,
                                    ignore_eos=True)):
        first, again = (under_pressure(llama_dir, truncated_draft, "swap") for _ in range(2))
        assert run(first, prompts, sampling) == run(again, prompts, sampling)
        assert speculator(first).totals.num_draft_tokens > 0


def test_sampled_drafts_of_a_draft_equal_to_the_target_are_kept(llama_dir):
    """Rejection sampling keeps a draft drawn from the target's own distribution (p = q); one
    that had to equal the target's separate draw would be kept with probability sum(p^2), a few
    percent for the tiny random model's flat distributions."""
    on = LLMEngine.from_kwargs(model=str(llama_dir), speculative_config=draft_config(llama_dir),
                               **TINY)
    run(on, prompts_with_repeats(4), SamplingParams(temperature=1.0, seed=7, max_tokens=32,
                                                    ignore_eos=True))
    totals = speculator(on).totals
    assert totals.num_accepted_tokens >= 0.9 * totals.num_draft_tokens > 0


def as_multi_head(path, out):
    """The same model with every key/value head repeated for each query head it serves: equal
    outputs, a KV cache of twice the heads."""
    model = load_hf(path)
    config = copy.deepcopy(model.config)
    groups = config.num_attention_heads // config.num_key_value_heads
    config.num_key_value_heads = config.num_attention_heads
    state = model.state_dict()
    for name in [n for n in state if n.endswith(("k_proj.weight", "v_proj.weight"))]:
        weight = state[name]  # [kv_heads * head_dim, hidden]
        heads = weight.view(-1, config.head_dim, weight.shape[1])
        state[name] = heads.repeat_interleave(groups, dim=0).reshape(-1, weight.shape[1])
    wide = type(model)(config)
    wide.load_state_dict(state)
    wide.save_pretrained(out)
    return out


def test_a_draft_model_of_another_kv_shape_keeps_its_own_kv(off, llama_dir, tmp_path):
    """Its layers hold twice the target's KV heads in the same blocks: nearly every draft is kept
    (it is the target's function) only if its KV follows through chunks, preemption by swap and
    copy-on-write (n > 1) in its own shape."""
    draft = as_multi_head(llama_dir, tmp_path / "mha")
    on = under_pressure(llama_dir, draft, "swap")
    worker = on.core.workers[0]
    assert worker.cache_engine.draft_gpu_cache[0].shape[3] == 2 * worker.kv_spec.num_kv_heads
    prompts = prompts_with_repeats(6)
    for sampling in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                     SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)):
        assert run(on, prompts, sampling) == run(off, prompts, sampling)
    totals = speculator(on).totals
    assert totals.num_accepted_tokens >= 0.95 * totals.num_draft_tokens > 0
    assert on.core.scheduler.num_preemptions > 0
