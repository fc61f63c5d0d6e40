"""The simulated worker: the real worker core with a modelled forward. Its tokens follow the
sim_token function through the whole engine (preemption, swaps and async scheduling included),
every block comes back, and no step takes less wall time than its model says."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import jsonschema
import pytest
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
)
from pagedserve.services.common.errors import ConfigError, InvalidRequest, StepOutOfOrder
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, RunningSequence, StepPlan
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.worker_svc.sampler import SeqSamplingState
from pagedserve.worker_svc.sim.sampler import SimSampler, sim_token
from pagedserve.worker_svc.sim.timeline import GpuTimeline
from pagedserve.worker_svc.sim.worker import SimWorker
from pagedserve.worker_svc.worker import create_worker
from transformers import AutoTokenizer

from pagedserve.llm_engine import LLMEngine
from tests import tiny_models
from tests.sim_tokens import expected_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[70 + i for i in range(n)] for n in (5, 13, 9, 21)]


def sim_engine(model_dir, **kw) -> LLMEngine:
    options = dict(model=str(model_dir), device="sim", sim_model="Llama-3-8B",
                   sim_time_scale=0.01, block_size=8, num_gpu_blocks_override=64,
                   num_cpu_blocks_override=32)
    return LLMEngine.from_kwargs(**{**options, **kw})


def run(engine: LLMEngine, prompts: list[list[int]], sampling=GREEDY) -> dict[str, list]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, sampling)
    outputs: dict[str, list] = {f"r{i}": [[] for _ in range(sampling.n)]
                                for i in range(len(prompts))}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            for completion in report.outputs:
                outputs[report.request_id][completion.index] += completion.token_ids
    assert not engine.has_unfinished_requests()
    load = engine.get_load()
    assert (load.num_gpu_blocks_used, load.num_cpu_blocks_used) == (0, 0), load
    return outputs


def test_greedy_tokens_are_the_sim_token_function(tiny_model_dir):
    engine = sim_engine(tiny_model_dir("llama"))
    vocab = engine.core.vocab_size
    assert engine.core.worker_info.device == "sim:H100-SXM"
    assert run(engine, PROMPTS) == {f"r{i}": [expected_greedy(p, 20, vocab)]
                                    for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_and_frees_every_block(tiny_model_dir, preemption_mode):
    """4 groups of 2 sequences of up to 41 tokens need ~36 blocks of 8; 12 force preemptions."""
    seeded = SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=20, ignore_eos=True)
    reference = run(sim_engine(tiny_model_dir("llama")), PROMPTS, seeded)
    engine = sim_engine(tiny_model_dir("llama"), num_gpu_blocks_override=12,
                        preemption_mode=preemption_mode)
    assert run(engine, PROMPTS, seeded) == reference
    assert engine.get_load().num_preemptions > 0
    assert all(len(c) == 20 for outs in reference.values() for c in outs)


def test_eos_probability_sets_output_lengths(tiny_model_dir):
    engine = sim_engine(tiny_model_dir("llama"), sim_eos_probability=0.1)
    sampling = SamplingParams(temperature=1.0, seed=1, max_tokens=200, min_tokens=2)
    lengths = [len(c) for outs in run(engine, [[80 + i] * 6 for i in range(40)],
                                      sampling).values() for c in outs]
    assert min(lengths) >= 3  # min_tokens, then the EOS itself
    assert 5 < sum(lengths) / len(lengths) < 20  # geometric, mean 1 / 0.1
    always = sim_engine(tiny_model_dir("llama"), sim_eos_probability=1.0)
    ignored = run(always, [[90] * 4], GREEDY)
    assert len(ignored["r0"][0]) == 20


def test_sampler_is_deterministic_and_respects_sampling_settings():
    sampler = SimSampler(1000, [2], eos_probability=0.0)

    def state(sampling, seed=None, num_samples=1, tokens=(5, 6, 7)):
        return SeqSamplingState(seq_id=1, sampling=sampling, token_ids=list(tokens),
                                prompt_len=3, seed=seed, num_samples=num_samples)

    greedy = SamplingParams(temperature=0.0)
    assert sampler(None, [state(greedy, seed=1)]) == sampler(None, [state(greedy, seed=2)])
    rand = SamplingParams(temperature=1.0, n=4, logprobs=3)
    a = sampler(None, [state(rand, seed=1, num_samples=4)])[0]
    assert a == sampler(None, [state(rand, seed=1, num_samples=4)])[0]
    assert a.token_ids != sampler(None, [state(rand, seed=2, num_samples=4)])[0].token_ids
    assert len(a.top_logprobs) == 4 and all(len(t) == 3 for t in a.top_logprobs)
    assert all(sampler.token_range.start <= t < sampler.token_range.stop for t in a.token_ids)
    copies = sampler(None, [state(SamplingParams(temperature=0.0, n=3), num_samples=3)])[0]
    assert len(set(copies.token_ids)) == 1 and len(copies.token_ids) == 3
    beams = SamplingParams(temperature=0.0, use_beam_search=True, best_of=3)
    b = sampler(None, [state(beams, num_samples=6)])[0]
    assert b.logprobs == sorted(b.logprobs, reverse=True)
    eos = SimSampler(1000, [2], eos_probability=1.0)
    assert eos(None, [state(SamplingParams(temperature=0.0))])[0].token_ids == [2]
    assert eos(None, [state(SamplingParams(temperature=0.0, min_tokens=1))])[0].token_ids != [2]


def test_timeline_never_returns_early_and_scale_zero_never_waits():
    timeline = GpuTimeline()
    for seconds in (0.0005, 0.003, 0.02):
        start = time.perf_counter()
        timeline.enqueue(seconds)
        timeline.synchronize()
        assert seconds <= time.perf_counter() - start < seconds + 1.0
    free = GpuTimeline(time_scale=0.0)
    free.enqueue(10.0)
    start = time.perf_counter()
    free.synchronize()
    assert time.perf_counter() - start < 1.0 and free.stats().busy_s == 0.0


def test_timeline_counts_kernel_time_as_busy_and_holds_the_launching_host():
    """An eager step keeps the device 10 ms of which 4 ms run kernels: the fence (the step's
    forward time) is the 10 ms, GPU busy the 4 ms; the host thread is held for its launches."""
    timeline = GpuTimeline()
    timeline.enqueue(0.010, busy_s=0.004)
    assert timeline.fence().device_s == pytest.approx(0.010)
    assert timeline.stats().busy_s == pytest.approx(0.004)
    start = time.perf_counter()
    timeline.hold_host(0.005)
    assert time.perf_counter() - start >= 0.005
    assert timeline.stats().num_syncs == 0


def _worker(model_dir, **device_kw) -> SimWorker:
    config = EngineConfig(model=ModelConfig(model=str(model_dir)),
                          cache=CacheConfig(block_size=8, num_gpu_blocks_override=32,
                                            num_cpu_blocks_override=8),
                          device=DeviceConfig(**{"device": "sim", "sim_model": "Llama-3-8B",
                                                 **device_kw}))
    worker = create_worker(config)
    assert isinstance(worker, SimWorker)
    worker.load_model()
    profile = worker.profile_memory()
    worker.init_cache(profile.num_gpu_blocks, profile.num_cpu_blocks, scheduler_epoch=1)
    return worker


@pytest.mark.parametrize("sim_step_model", ["kernels", "roofline"])
def test_a_step_takes_at_least_its_modelled_time(tiny_model_dir, sim_step_model):
    """On an L4 a Llama-3-8B step is ~50 ms: long enough to see, the upper margin generous."""
    worker = _worker(tiny_model_dir("llama"), sim_gpu="L4", sim_step_model=sim_step_model)
    prompt = list(range(70, 86))
    plan = StepPlan(scheduler_epoch=1, step_id=1, new_seqs=[NewSequence(
        seq_id=1, request_id="r", token_ids=prompt, prompt_len=16, block_ids=[0, 1, 2],
        num_computed_tokens=0, num_scheduled_tokens=16, sampling=GREEDY)])
    decode = StepPlan(scheduler_epoch=1, step_id=2, previous_step_id=1, running_seqs=[
        RunningSequence(seq_id=1, new_token_ids=[], block_ids_start=3, block_ids=[],
                        num_scheduled_tokens=1)], blocks_to_copy=[(0, 5)])
    for step, query_len, context_len in ((plan, 16, 0), (decode, 1, 16)):
        if worker.step_model is None:
            modelled = worker.roofline.step([query_len], [context_len], 1).time_s
        else:
            modelled = worker.step_model.step([query_len], [context_len], 1).device_s
        if step.blocks_to_copy:
            modelled += worker.roofline.block_moves_s(0, 1, worker.kv_spec.bytes_per_block)
        start = time.perf_counter()
        output = worker.execute_step(step)
        wall = time.perf_counter() - start
        assert modelled > 0.04
        assert modelled <= wall < modelled + 2.0
        # the modelled device time of the step, its block copy included
        assert output.timings.forward_ns == pytest.approx(modelled * 1e9, rel=1e-6)
        assert len(output.sampled_by_seq()) == 1


def test_cache_ops_out_of_range_are_refused_before_the_step_runs(tiny_model_dir):
    """As on the real worker: a refused step never ran, so its successor is out of order and a
    corrected retry of it needs no ClearState."""
    worker = _worker(tiny_model_dir("llama"), sim_time_scale=0.0)
    with pytest.raises(InvalidRequest, match="out of range"):
        worker.execute_step(StepPlan(scheduler_epoch=1, step_id=1,
                                     blocks_to_swap_in=[(8, 0)]))
    with pytest.raises(StepOutOfOrder, match="last step is 0"):
        worker.execute_step(StepPlan(scheduler_epoch=1, step_id=2, previous_step_id=1))
    worker.execute_step(StepPlan(scheduler_epoch=1, step_id=1, blocks_to_swap_out=[(31, 7)]))


def test_the_sim_refuses_what_it_does_not_model(tiny_model_dir):
    with pytest.raises(ConfigError, match="16-bit"):
        SimWorker(EngineConfig(model=ModelConfig(model=str(tiny_model_dir("llama")),
                                                 dtype="float32"),
                               device=DeviceConfig(device="sim")))
    with pytest.raises(ConfigError, match="sim_model must be one of"):
        _worker(tiny_model_dir("llama"), sim_model="GPT-5")


def test_the_sampler_draws_what_sim_token_says_for_every_kind_of_row():
    """The sampler hashes a step at once in numpy; sim_token, one draw in Python, is the rule."""
    rng = random.Random(0)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, n=2, logprobs=2),
             SamplingParams(temperature=1.0, ignore_eos=True),
             SamplingParams(temperature=0.5, min_tokens=3)]
    for vocab_size, eos_probability in ((49152, 0.3), (1000, 0.0), (50, 1.0)):
        sampler = SimSampler(vocab_size, [2], eos_probability, seed=rng.randrange(2**63))
        seqs = [SeqSamplingState(
            seq_id=i, sampling=rng.choice(kinds),
            token_ids=[rng.randrange(vocab_size) for _ in range(rng.choice([1, 2, 4, 5, 8]))],
            prompt_len=1, seed=rng.choice([None, rng.randrange(2**64), -5]),
            num_samples=rng.choice([1, 2])) for i in range(200)]
        for s, got in zip(seqs, sampler(None, seqs), strict=True):
            is_greedy = s.sampling.is_greedy
            seed = sampler.seed if is_greedy or s.seed is None else s.seed
            may_end = not s.sampling.ignore_eos and s.num_output_tokens >= s.sampling.min_tokens
            expected = [sim_token(seed, len(s.token_ids), s.token_ids, 0 if is_greedy else j,
                                  sampler.token_range,
                                  2 if may_end else None, eos_probability)
                        for j in range(s.num_samples)]
            assert (got.token_ids, got.logprobs) == ([t for t, _ in expected],
                                                     [lp for _, lp in expected])


def test_constrained_draws_on_sim_follow_their_schema_and_the_others_stay_sim_tokens(smollm2_dir):
    from transformers import AutoTokenizer

    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]},
                                               "count": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
              "required": ["size", "count"], "additionalProperties": False}
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json_schema=schema))
    engine = sim_engine(smollm2_dir)
    requests = {"free": (PROMPTS[0], GREEDY), "a": (PROMPTS[1], constrained),
                "b": (PROMPTS[2], dataclasses.replace(constrained, seed=4))}
    for request_id, (ids, sampling) in requests.items():
        engine.add_request(request_id, ids, sampling)
    outputs = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for report in engine.step():
            for completion in report.outputs:
                outputs[report.request_id] += completion.token_ids
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for request_id in ("a", "b"):
        text = tokenizer.decode(outputs[request_id], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
    assert outputs["free"] == expected_greedy(PROMPTS[0], 20, engine.core.vocab_size)


def test_constrained_draws_on_sim_use_the_tokenizer_flag(tmp_path):
    """A served folder without a tokenizer, its tokenizer given by --tokenizer: the sim worker's
    grammars compile against that one."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    weights, tokenizer = tiny_models.split_tokenizer(
        tiny_models.make_served_model(tmp_path / "served"), tmp_path / "split")
    engine = sim_engine(weights, tokenizer=str(tokenizer))
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                              structured_outputs=StructuredOutputsParams(json_schema=schema))
    outputs = run(engine, [PROMPTS[0]], sampling)["r0"][0]
    text = AutoTokenizer.from_pretrained(tokenizer).decode(outputs, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


def test_swaps_report_their_modelled_time_by_direction(tiny_model_dir):
    """A prefill that swaps two blocks out and three in: each direction's time is its blocks'
    bytes over the host link, and both are in cache_ops_ns."""
    worker = _worker(tiny_model_dir("llama"), sim_time_scale=0.0)
    plan = StepPlan(scheduler_epoch=1, step_id=1, new_seqs=[NewSequence(
        seq_id=1, request_id="r", token_ids=list(range(70, 86)), prompt_len=16,
        block_ids=[0, 1], num_computed_tokens=0, num_scheduled_tokens=16, sampling=GREEDY)],
        blocks_to_swap_out=[(5, 0), (6, 1)], blocks_to_swap_in=[(2, 7), (3, 8), (4, 9)])
    timings = worker.execute_step(plan).timings
    block_s = worker.roofline.block_moves_s(1, 0, worker.kv_spec.bytes_per_block)
    assert timings.swap_out_ns == pytest.approx(2 * block_s * 1e9, abs=1)
    assert timings.swap_in_ns == pytest.approx(3 * block_s * 1e9, abs=1)
    assert timings.cache_ops_ns >= timings.swap_out_ns + timings.swap_in_ns
