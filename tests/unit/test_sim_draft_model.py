"""A draft model on the simulated GPU: drafts are the target's next draws at the configured rate,
verification keeps the outputs of speculation off, and the draft's weights and KV layers take
their share of the modelled device."""

from __future__ import annotations

import json

import pytest
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.test_spec_decode import speculator
from tests.unit.test_sim_worker import GREEDY, PROMPTS, run, sim_engine

DRAFT = json.dumps({"method": "draft_model", "model": "Llama-3.2-1B",
                    "num_speculative_tokens": 4, "adaptive": False})


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=7,
                                                             max_tokens=20, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_outputs_equal_speculation_off_and_drafts_match_at_the_rate(tiny_model_dir, sampling):
    model_dir = tiny_model_dir("llama")
    expected = run(sim_engine(model_dir), PROMPTS, sampling)
    kept = {}
    for acceptance in (0.0, 0.6, 1.0):
        engine = sim_engine(model_dir, speculative_config=DRAFT, sim_draft_acceptance=acceptance)
        assert run(engine, PROMPTS, sampling) == expected
        totals = speculator(engine).totals
        assert totals.num_draft_tokens > 0
        kept[acceptance] = totals.num_accepted_tokens / totals.num_draft_tokens
    # a draft is kept when every one before it was: 0.6, then 0.36, ... (mean ~0.33 for four)
    assert kept[0.0] == 0.0 and kept[1.0] == 1.0 and 0.15 < kept[0.6] < 0.55


def test_the_draft_models_weights_and_kv_layers_take_device_memory(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    kw = dict(num_gpu_blocks_override=0, block_size=16)
    alone = sim_engine(model_dir, **kw).core.workers[0]
    with_draft = sim_engine(model_dir, speculative_config=DRAFT, **kw).core.workers[0]
    spec = with_draft.kv_spec
    # Llama-3.2-1B: 16 layers of 8 KV heads of 64 beside Llama-3-8B's 32 of 8 of 128
    assert (spec.num_draft_layers, spec.draft_num_kv_heads, spec.draft_head_size) == (16, 8, 64)
    assert spec.bytes_per_block == alone.kv_spec.bytes_per_block * 5 // 4
    profile, profile_alone = with_draft.profile_memory(), alone.profile_memory()
    assert profile.weights_bytes - profile_alone.weights_bytes == pytest.approx(2.47e9, rel=0.01)
    assert profile.num_gpu_blocks < profile_alone.num_gpu_blocks * 4 / 5
