"""A draft model on the simulated GPU: drafts are the target's next draws at the configured rate,
verification keeps the outputs of speculation off, the draft's weights and KV layers take their
share of the modelled device, and its forwards' time is reported apart from the target's."""

from __future__ import annotations

import json

import pytest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import StepTimings

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


def _decode_step_timings(engine) -> list[tuple[int, StepTimings]]:
    """(lookahead slots, timings) of each step that only decodes, once run."""
    worker, seen = engine.core.workers[0], []
    submit = worker.submit_step

    def recording(plan):
        future = submit(plan)
        if not plan.new_seqs and all(s.num_scheduled_tokens == 1 + s.num_lookahead_slots
                                     for s in plan.running_seqs):
            num_slots = sum(s.num_lookahead_slots for s in plan.running_seqs)
            future.add_done_callback(lambda f: seen.append((num_slots, f.result().timings)))
        return future

    worker.submit_step = recording
    return seen


def test_the_worker_times_the_draft_models_forwards_apart_from_the_targets(tiny_model_dir):
    """A step's draft_ns is its draft forwards' modelled time, and its forward_ns stays the
    target's: a verification's, about a decode step's without speculation (memory-bound)."""
    model_dir = tiny_model_dir("llama")
    off, on = sim_engine(model_dir), sim_engine(model_dir, speculative_config=DRAFT,
                                                sim_draft_acceptance=0.6)
    off_steps, on_steps = _decode_step_timings(off), _decode_step_timings(on)
    run(off, PROMPTS[:2])
    run(on, PROMPTS[:2])
    assert off_steps and all(t.draft_ns == 0 for _, t in off_steps)
    drafting = [t for num_slots, t in on_steps if num_slots]
    assert drafting and all(t.draft_ns > 0 for t in drafting)
    decode_ns = max(t.forward_ns for _, t in off_steps)
    assert max(t.forward_ns for t in drafting) < 1.2 * decode_ns
    assert min(t.draft_ns for t in drafting) > 0.1 * decode_ns
