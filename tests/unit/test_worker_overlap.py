"""A step launched while the one before is in flight: its inputs read that step's draws on the
device, and every output is the one that running the steps one at a time gives (greedy and
seeded sampling, the real model on CPU and the simulated GPU behind the model thread); and the
scheduler's side of the pipeline, which keeps two steps in flight."""

from __future__ import annotations

import dataclasses
import types

import pytest
from pagedserve.services.common.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from pagedserve.services.common.errors import InvalidRequest, StepOutOfOrder
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import RunningSequence, StepPlan
from pagedserve.worker_svc.sequence_mirrors import SequenceMirrors
from pagedserve.worker_svc.sim.worker import SimWorker

from pagedserve.llm_engine import LLMEngine
from tests.integration.worker_driver import make_worker, prefill_then_decodes

BLOCK_SIZE = 8
SAMPLINGS = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True, logprobs=2)]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NUM_DECODE_STEPS = 10


def _plans(epoch: int = 1) -> list[StepPlan]:
    return prefill_then_decodes(PROMPTS, SAMPLINGS, NUM_DECODE_STEPS, BLOCK_SIZE, epoch)


def _tokens(outputs) -> list[dict[int, tuple]]:
    return [{seq_id: (s.token_ids, s.logprobs, s.top_logprobs)
             for seq_id, s in out.sampled_by_seq().items()} for out in outputs]


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
    return _tokens([worker.execute_step(plan) for plan in _plans()]), worker


def test_steps_launched_ahead_give_the_outputs_of_steps_one_at_a_time(tiny_model_dir,
                                                                      one_at_a_time):
    expected, reference = one_at_a_time
    worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
    plans = _plans()
    outputs = []
    in_flight = worker.launch_step(plans[0])
    worker.sample_step(in_flight)
    for plan in plans[1:]:
        assert worker.steps.can_launch_ahead(in_flight, plan, worker.runner) is False  # CPU: the host is the device
        ahead = worker.launch_step(plan, ahead_of=in_flight)
        assert worker.runner.mirrors.drawing == {0: 2, 1: 2}
        outputs.append(worker.finish_step(in_flight))
        worker.sample_step(ahead)
        in_flight = ahead
    outputs.append(worker.finish_step(in_flight))
    assert _tokens(outputs) == expected
    assert not worker.runner.mirrors.drawing
    for seq_id, seq in worker.runner.mirrors.seqs.items():
        assert seq.token_ids == reference.runner.mirrors.seqs[seq_id].token_ids


def _sim_worker(tiny_model_dir) -> SimWorker:
    """A Llama-3-8B step on an H100 is ~5 ms, ten times that here: the plans submitted together
    wait in the queue, and a step is still on the device when the next one is launched however
    slow a loaded host is (a step already done there is finished first, not launched ahead of)."""
    worker = SimWorker(EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir("llama"))),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
                          num_cpu_blocks_override=8),
        device=DeviceConfig(device="sim", sim_model="Llama-3-8B", sim_time_scale=10.0)))
    worker.load_model()
    worker.init_cache(64, 8, 1)
    return worker


def test_the_model_thread_launches_steps_ahead_on_the_simulated_gpu(tiny_model_dir):
    reference = _sim_worker(tiny_model_dir)
    expected = _tokens([reference.execute_step(plan) for plan in _plans()])
    worker = _sim_worker(tiny_model_dir)
    futures = [worker.submit_step(plan) for plan in _plans()]
    assert _tokens([f.result(timeout=60) for f in futures]) == expected
    assert worker.steps.num_launched_ahead >= NUM_DECODE_STEPS // 2
    assert not worker.runner.mirrors.drawing


def test_a_bad_step_launched_ahead_fails_alone(tiny_model_dir):
    worker = _sim_worker(tiny_model_dir)
    plans = _plans()
    bad = StepPlan(1, 2, previous_step_id=1, running_seqs=[
        RunningSequence(0, [], 0, [10_000], 1)])
    futures = [worker.submit_step(p) for p in (plans[0], bad, *plans[1:])]
    with pytest.raises(InvalidRequest, match="block_ids"):
        futures[1].result(timeout=60)
    assert len(futures[0].result(timeout=60).sampled_by_seq()) == 2
    assert all(len(f.result(timeout=60).sampled_by_seq()) == 2 for f in futures[2:])


def test_a_failed_step_fails_the_step_launched_ahead_of_it(tiny_model_dir):
    worker = _sim_worker(tiny_model_dir)
    sampler_launch = worker.runner.sampler.launch
    launches = []

    def launch(logits, seqs):
        samples = sampler_launch(logits, seqs)
        launches.append(samples)
        if len(launches) != 2:
            return samples

        def lost():
            raise RuntimeError("the draws of step 2 are lost")
        return types.SimpleNamespace(token_ids=samples.token_ids, offsets=samples.offsets,
                                     result=lost, host_samples=lost)

    worker.runner.sampler.launch = launch
    futures = [worker.submit_step(p) for p in _plans()[:4]]
    assert len(futures[0].result(timeout=60).sampled_by_seq()) == 2
    with pytest.raises(RuntimeError, match="lost"):
        futures[1].result(timeout=60)
    with pytest.raises(StepOutOfOrder, match="launched after step 2, which failed"):
        futures[2].result(timeout=60)
    with pytest.raises(StepOutOfOrder, match="ClearState first"):
        futures[3].result(timeout=60)
    assert worker.steps.num_launched_ahead >= 1


def test_a_delta_may_not_add_tokens_after_one_being_drawn():
    mirrors = SequenceMirrors(BLOCK_SIZE, 1024)
    plan = _plans()[0]
    scheduled = mirrors.apply(plan)
    mirrors.mark_computed(scheduled)
    assert mirrors.drawing == {0: 1, 1: 1}
    mirrors.apply(StepPlan(1, 2, previous_step_id=1, running_seqs=[
        RunningSequence(0, [], 2, [], 1)]))  # decodes the token being drawn
    with pytest.raises(InvalidRequest, match="not drawn yet"):
        mirrors.apply(StepPlan(1, 3, previous_step_id=2, running_seqs=[
            RunningSequence(1, [42], 2, [], 1)]))


def test_the_scheduler_sends_the_next_step_before_it_reports_one(tiny_model_dir):
    """Step n+2 goes out once step n's tokens are in, before step n's reports are built."""
    engine = LLMEngine.from_kwargs(
        model=str(tiny_model_dir("llama")), device="sim", sim_model="Llama-3-8B",
        sim_time_scale=0.01, block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
        num_cpu_blocks_override=8)
    core, events = engine.core, []
    worker, processor = core.workers[0], core.output_processor
    submit, report = worker.submit_step, processor.report

    def sent(plan):
        events.append(("sent", plan.step_id))
        return submit(plan)

    def reported(groups):
        events.append(("reported", core.last_scheduled.plan.step_id))
        return report(groups)

    worker.submit_step, processor.report = sent, reported
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SAMPLINGS[0])
    while engine.has_unfinished_requests():
        engine.step()
    reports = [n for kind, n in events if kind == "reported"]
    assert len(reports) >= 60
    for n in reports:
        if ("sent", n + 2) in events:
            assert events.index(("sent", n + 2)) < events.index(("reported", n))
    # the last one sent may still be in flight, its sequences all finished: nothing to report
    assert reports[-1] >= max(n for kind, n in events if kind == "sent") - 1


def test_single_samples_come_back_packed_with_the_tokens_of_sampled_sequences(tiny_model_dir):
    """Without top logprobs a decode step's draws travel packed; the mirror appends them (the
    next step's inputs read them) as it does a SampledSequence's, so the tokens are the same."""
    plain = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True)]
    runs = []
    for samplings in (plain, [dataclasses.replace(s, logprobs=0) for s in plain]):
        worker = make_worker(tiny_model_dir("llama"), block_size=BLOCK_SIZE)
        runs.append([worker.execute_step(plan) for plan in prefill_then_decodes(
            PROMPTS, samplings, NUM_DECODE_STEPS, BLOCK_SIZE, 1)])
    packed, sampled = runs
    assert all(not out.outputs and out.sampled_seq_ids == [0, 1] for out in packed)
    assert all(len(out.outputs) == 2 and not out.sampled_seq_ids for out in sampled)
    assert ([{i: s.token_ids for i, s in out.sampled_by_seq().items()} for out in packed]
            == [{i: s.token_ids for i, s in out.sampled_by_seq().items()} for out in sampled])
