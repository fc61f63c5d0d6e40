"""Speculative decoding end to end through LLMEngine and LLM: outputs token for token those of speculation
off (greedy, and seeded sampling), with drafts proposed and accepted along the way."""

from __future__ import annotations

import json

import pytest
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm import LLM
from pagedserve.llm_engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# up to 12 drafts, one per token the match agrees on
SCALED = {**NGRAM, "num_speculative_tokens": 12, "prompt_lookup_max_spec_factor": 1.0}
TINY = dict(device="cpu", attention_backend="torch", block_size=8, num_threads=1)


def prompts_with_repeats(num: int) -> list[list[int]]:
    """Token ids repeating a phrase, as a rewrite prompt does: lookups find matches."""
    return [[5 + i, *([20 + i, 21, 22, 23, 24 + i, 25, 26] * 3), 20 + i, 21] for i in range(num)]


def run(engine: LLMEngine, prompts: list[list[int]],
        sampling: SamplingParams) -> dict[tuple[int, int], list[int]]:
    """(prompt, output index) → its tokens."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, sampling)
    tokens: dict[tuple[int, int], list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            for out in report.outputs:
                tokens.setdefault((int(report.request_id[1:]), out.index), []).extend(
                    out.token_ids)
    assert not engine.has_unfinished_requests()
    load = engine.get_load()
    assert (load.num_gpu_blocks_used, load.num_cpu_blocks_used) == (0, 0)
    return tokens


@pytest.fixture(scope="module")
def tiny_pair(llama_dir):
    """The tiny Llama with speculation off, and on under pressure: few blocks (preemption),
    chunked prefill and prefix caching."""
    off = LLMEngine.from_kwargs(model=str(llama_dir), **TINY)
    # random weights echo little: every lookup is verified (no back-off), single tokens match
    config = {**NGRAM, "prompt_lookup_min": 1, "adaptive": False}
    on = LLMEngine.from_kwargs(model=str(llama_dir), speculative_config=json.dumps(config),
                               num_gpu_blocks_override=40, num_cpu_blocks_override=64,
                               enable_prefix_caching=True, max_num_batched_tokens=32, **TINY)
    return off, on


def speculator(engine: LLMEngine):
    return engine.core.scheduler.speculator


def test_greedy_outputs_equal_speculation_off(tiny_pair):
    off, on = tiny_pair
    prompts = prompts_with_repeats(6)
    sampling = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    totals = speculator(on).totals
    before = totals.num_draft_tokens, totals.num_accepted_tokens
    assert run(on, prompts, sampling) == run(off, prompts, sampling)
    # drafts were rejected and kept along the way
    assert totals.num_draft_tokens - before[0] > totals.num_accepted_tokens - before[1] > 0
    assert on.core.scheduler.num_preemptions > 0


def test_match_scaled_drafts_keep_greedy_outputs(tiny_pair, llama_dir):
    off, _ = tiny_pair
    config = {**SCALED, "prompt_lookup_min": 1, "adaptive": False}
    on = LLMEngine.from_kwargs(model=str(llama_dir),
                               speculative_config=json.dumps(config),
                               num_gpu_blocks_override=40, num_cpu_blocks_override=64,
                               enable_prefix_caching=True, max_num_batched_tokens=32, **TINY)
    prompts = prompts_with_repeats(6)
    sampling = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    assert run(on, prompts, sampling) == run(off, prompts, sampling)
    totals = speculator(on).totals
    assert totals.num_draft_tokens > totals.num_accepted_tokens > 0


def test_seeded_sampling_equals_speculation_off(tiny_pair):
    off, on = tiny_pair
    prompts = prompts_with_repeats(4)
    sampling = SamplingParams(temperature=0.7, top_k=20, seed=11, max_tokens=32,
                              ignore_eos=True)
    assert run(on, prompts, sampling) == run(off, prompts, sampling)


def test_n_greater_than_one_and_beam_search_run_alongside(tiny_pair):
    off, on = tiny_pair
    prompts = prompts_with_repeats(2)
    for sampling in (SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24,
                                    ignore_eos=True),
                     SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=12,
                                    ignore_eos=True)):
        assert run(on, prompts, sampling) == run(off, prompts, sampling)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, SCALED], ids=["fixed", "scaled"])
def test_smollm2_greedy_rewrite_equals_speculation_off(smollm2_dir, spec):
    kw = dict(device="cpu", attention_backend="torch", num_gpu_blocks_override=128,
              num_cpu_blocks_override=16, num_threads=1)
    off = LLM(str(smollm2_dir), **kw)
    on = LLM(str(smollm2_dir), speculative_config=spec, **kw)
    text = ("Repeat this sentence exactly: the paged KV cache keeps each sequence's keys and "
            "values in fixed-size blocks, allocated as the sequence grows.")
    prompt = off.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    expected, = off.generate([prompt], sampling, use_tqdm=False)
    got, = on.generate([prompt], sampling, use_tqdm=False)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    totals = on.engine.core.scheduler.speculator.totals
    assert totals.num_accepted_tokens > 0
    # the copied sentence is a long match: scaled drafts run past the fixed 4 and are kept
    assert (sum(totals.num_accepted_tokens_per_pos[4:]) > 0) == (spec is SCALED)


def test_the_simulated_gpu_keeps_its_outputs_with_speculation(llama_dir):
    """The worker launches steps ahead on the simulated GPU: a verified step must not be."""
    options = dict(model=str(llama_dir), device="sim", sim_model="Llama-3-8B", sim_time_scale=0.01,
                   block_size=8, num_gpu_blocks_override=64, num_cpu_blocks_override=32)
    config = json.dumps({**NGRAM, "prompt_lookup_min": 1, "adaptive": False})
    prompts = prompts_with_repeats(4)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    on = LLMEngine.from_kwargs(speculative_config=config, **options)
    assert run(on, prompts, sampling) == run(LLMEngine.from_kwargs(**options), prompts, sampling)
    assert speculator(on).totals.num_draft_tokens > 0
