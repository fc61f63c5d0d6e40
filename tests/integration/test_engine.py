"""The in-process engine with real workers on a tiny random-weight model: a request's greedy
output does not depend on preemption, prefix caching, chunked prefill or async scheduling (on by
default; the reference runs without it), and every block is free at the end."""

from __future__ import annotations

import random

import pytest
from pagedserve.scheduler_svc.engine_core import MAX_REBUILDS_IN_A_ROW
from pagedserve.services.common.errors import ConfigError, InvalidRequest, NotFound, Unavailable
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.worker import Worker

from pagedserve.llm_engine import LLMEngine, engine_config_from_kwargs
from tests.scheduled_steps import ScheduledSteps

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    options = dict(model=str(model_dir), device="cpu", attention_backend="torch", block_size=8,
                   num_gpu_blocks_override=128, num_cpu_blocks_override=64, num_threads=1)
    options.update(kw)
    return LLMEngine.from_kwargs(**options)


def prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def generate(engine: LLMEngine, prompt_ids: list[list[int]],
             sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, sampling)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            tokens[report.request_id] += report.outputs[0].token_ids if report.outputs else []
            if report.finished:
                assert report.outputs[0].finish_reason == "length", report
    assert not engine.has_unfinished_requests()
    return tokens


def assert_all_blocks_free(engine: LLMEngine) -> None:
    load = engine.get_load()
    assert load.num_gpu_blocks_used == 0 and load.num_cpu_blocks_used == 0, load
    assert (load.num_running, load.num_waiting, load.num_swapped) == (0, 0, 0)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy outputs with a pool large enough that nothing is preempted, one step at a time."""
    engine = make_engine(llama_dir, async_scheduling=False)
    out = generate(engine, prompts(0, [13, 29, 7, 21]))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in out.values())
    assert engine.get_load().num_preemptions == 0
    assert_all_blocks_free(engine)
    return out


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_does_not_change_greedy_output(llama_dir, reference, preemption_mode,
                                                  async_scheduling):
    # 4 sequences of up to 53 tokens need 26 blocks of 8; 12 force preemptions
    engine = make_engine(llama_dir, num_gpu_blocks_override=12, preemption_mode=preemption_mode,
                         async_scheduling=async_scheduling)
    assert generate(engine, prompts(0, [13, 29, 7, 21])) == reference
    assert engine.get_load().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_chunked_prefill_on_and_off_agree(llama_dir, reference):
    chunked = make_engine(llama_dir, max_num_batched_tokens=16)  # every prompt > 16 is chunked
    assert generate(chunked, prompts(0, [13, 29, 7, 21])) == reference
    whole = make_engine(llama_dir, enable_chunked_prefill=False)
    assert generate(whole, prompts(0, [13, 29, 7, 21])) == reference
    assert_all_blocks_free(chunked)
    assert_all_blocks_free(whole)


def test_prefix_cache_hits_and_outputs_do_not_change(llama_dir):
    shared = prompts(1, [24])[0]  # three full blocks of 8
    batch = prompts(2, [5, 9, 3], prefix=shared)
    expected = {}
    for i, ids in enumerate(batch):  # one at a time, so nothing could be shared anyway
        expected[f"r{i}"] = generate(make_engine(llama_dir), [ids])["r0"]
    cached = make_engine(llama_dir, enable_prefix_caching=True)
    first = generate(cached, batch[:1])
    assert first["r0"] == expected["r0"] and len(first["r0"]) == GREEDY.max_tokens
    later = {}
    for i, ids in enumerate(batch[1:], start=1):
        cached.add_request(f"r{i}", ids, GREEDY)
        later[f"r{i}"] = []
    while cached.has_unfinished_requests():
        for report in cached.step():
            later[report.request_id] += report.outputs[0].token_ids
            if report.finished:
                assert report.num_cached_tokens == 24
    assert later == {k: v for k, v in expected.items() if k != "r0"}
    assert cached.get_load().prefix_cache_hit_rate > 0
    assert_all_blocks_free(cached)


def test_bad_requests_fail_alone(llama_dir):
    engine = make_engine(llama_dir, max_model_len=64)
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidRequest, match="max_model_len=64"):
        engine.add_request("long", [5] * 64, GREEDY)
    with pytest.raises(InvalidRequest, match="vocab_size"):
        engine.add_request("oov", [5, 999], GREEDY)
    engine.add_request("ok", [5, 6, 7], GREEDY)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("ok", [5], GREEDY)
    with pytest.raises(NotFound):
        engine.abort_request("nope")
    engine.step()
    report = engine.abort_request("ok")
    assert report.finished and report.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_prompt_larger_than_the_whole_cache_is_rejected_up_front(llama_dir):
    engine = make_engine(llama_dir, num_gpu_blocks_override=4)  # 4 blocks of 8 tokens
    with pytest.raises(InvalidRequest, match="40 tokens, which need 5 KV-cache blocks"):
        engine.add_request("huge", [5] * 40, GREEDY)
    engine.add_request("fits", [5] * 24, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


class FlakyWorker:
    """A real worker whose step fails once, on the step chosen by the test."""

    def __init__(self, worker, fail_on_step: int) -> None:
        self.worker = worker
        self.fail_on_step = fail_on_step

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        if plan.step_id == self.fail_on_step:
            raise RuntimeError("device lost")
        return self.worker.submit_step(plan)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_failed_step_errors_its_requests_and_the_engine_keeps_serving(llama_dir, reference,
                                                                        async_scheduling):
    engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    core = engine.core
    core.workers = [FlakyWorker(core.workers[0], fail_on_step=core.scheduler._step_id + 3)]
    engine.add_request("victim", prompts(0, [13])[0], GREEDY)
    reports = []
    for _ in range(4):
        reports += engine.step()
    failed = [r for r in reports if r.finished]
    assert failed and failed[0].outputs[0].finish_reason == "error"
    assert "device lost" in failed[0].outputs[0].error
    assert_all_blocks_free(engine)
    assert generate(engine, prompts(0, [13, 29, 7, 21])) == reference


class RestartingWorker:
    """A real worker that restarts -- a fresh Worker with its model loaded and no KV cache, as a
    worker process comes back -- just before each step `crashes(plan)` picks."""

    def __init__(self, worker, crashes) -> None:
        self.worker = worker
        self.crashes = crashes
        self.num_restarts = 0
        self.is_back = True  # False: load_model fails, the worker never comes back

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        if self.crashes(plan):
            self.worker = Worker(self.worker.config)
            self.worker.load_model()
            self.num_restarts += 1
        return self.worker.submit_step(plan)

    def load_model(self):
        if not self.is_back:
            raise Unavailable("worker 10.0.0.7:50052 LoadModel: connection refused")
        return self.worker.load_model()


def restarting(engine: LLMEngine, crashes) -> RestartingWorker:
    worker = RestartingWorker(engine.core.workers[0], crashes)
    engine.core.workers = [worker]
    return worker


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_restarted_worker_is_rebuilt_and_no_request_is_lost(llama_dir, reference,
                                                              async_scheduling):
    # a small pool with swapping and prefix caching: at the crashes, requests are running,
    # swapped and waiting, and cached blocks point at KV the restart wiped
    engine = make_engine(llama_dir, num_gpu_blocks_override=12, preemption_mode="swap",
                         enable_prefix_caching=True, async_scheduling=async_scheduling)
    first = engine.core.scheduler._step_id + 1
    worker = restarting(engine, lambda plan: plan.step_id in (first + 5, first + 30))
    assert generate(engine, prompts(0, [13, 29, 7, 21])) == reference
    assert worker.num_restarts == engine.get_load().num_worker_rebuilds == 2
    assert_all_blocks_free(engine)
    assert engine.get_load().num_preemptions > 0


def test_requests_that_keep_bringing_the_worker_down_end_with_an_error(llama_dir, reference):
    engine = make_engine(llama_dir)
    worker = restarting(engine, lambda plan: any(
        s.request_id == "poison" for s in plan.new_seqs))
    engine.add_request("poison", prompts(5, [9])[0], GREEDY)
    reports = []
    while engine.has_unfinished_requests():
        reports += engine.step()
    (report,) = [r for r in reports if r.finished]
    assert report.outputs[0].finish_reason == "error"
    assert f"lost {MAX_REBUILDS_IN_A_ROW} times in a row" in report.outputs[0].error
    assert worker.num_restarts == MAX_REBUILDS_IN_A_ROW
    assert_all_blocks_free(engine)
    assert generate(engine, prompts(0, [13, 29, 7, 21])) == reference


def test_a_worker_that_does_not_come_back_fails_every_request_until_it_does(llama_dir,
                                                                           reference):
    engine = make_engine(llama_dir)
    first = engine.core.scheduler._step_id + 1
    worker = restarting(engine, lambda plan: plan.step_id == first + 2)
    worker.is_back = False
    for i, ids in enumerate(prompts(0, [13, 29])):
        engine.add_request(f"r{i}", ids, GREEDY)
    reports = []
    for _ in range(5):
        reports += engine.step()
    errors = {r.request_id: r.outputs[0].error for r in reports if r.finished}
    assert set(errors) == {"r0", "r1"}
    assert all("not rebuilt" in e and "connection refused" in e for e in errors.values())
    assert_all_blocks_free(engine)
    worker.is_back = True  # the next step fails, and rebuilds it
    assert generate(engine, prompts(0, [13, 29, 7, 21])) == reference


def test_the_engine_seed_repeats_unseeded_samples_in_a_fresh_engine(llama_dir):
    """vLLM's engine `seed`: requests without a seed of their own draw the same tokens in a
    fresh engine of the same seed, and others under another seed."""
    sampling = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def sampled(seed: int) -> dict[str, list[int]]:
        return generate(make_engine(llama_dir, seed=seed), prompts(1, [9, 17, 5]), sampling)

    first = sampled(3)
    assert sampled(3) == first
    assert sampled(4) != first


def test_flat_options_build_the_config_tree_and_unknown_ones_are_rejected():
    config = engine_config_from_kwargs(model="m", block_size=32, max_num_seqs=7,
                                       enable_prefix_caching=True, attention_backend="torch")
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 7)
    assert config.cache.enable_prefix_caching and config.device.attention_backend == "torch"
    with pytest.raises(ConfigError, match="blok_size"):
        engine_config_from_kwargs(model="m", blok_size=32)
    with pytest.raises(ConfigError, match="block_size"):
        engine_config_from_kwargs(model="m", block_size=7)


def all_outputs(engine: LLMEngine, prompt_ids: list[list[int]],
                sampling: SamplingParams) -> dict[str, list[list[int]]]:
    """Every index's whole output per request (streamed deltas joined, or the final report)."""
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, sampling)
    tokens: dict[str, dict[int, list[int]]] = {f"r{i}": {} for i in range(len(prompt_ids))}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            for out in report.outputs:
                tokens[report.request_id].setdefault(out.index, []).extend(out.token_ids)
    assert not engine.has_unfinished_requests()
    return {rid: [by_index[i] for i in sorted(by_index)] for rid, by_index in tokens.items()}


@pytest.mark.parametrize("sampling", [
    SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
    SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=12),
], ids=["seeded_n2", "beam3"])
@pytest.mark.parametrize("preemption_mode", ["auto", "recompute"])
def test_forked_groups_do_not_depend_on_preemption(llama_dir, sampling, preemption_mode):
    batch = prompts(3, [11, 19, 6])
    expected = all_outputs(make_engine(llama_dir), batch, sampling)
    assert all(len(outs) == 2 for outs in expected.values())
    engine = make_engine(llama_dir, num_gpu_blocks_override=14, preemption_mode=preemption_mode)
    assert all_outputs(engine, batch, sampling) == expected
    assert engine.get_load().num_preemptions > 0
    assert_all_blocks_free(engine)


class RecordingWorker:
    """A real worker that logs when each step is submitted and when its result is taken."""

    def __init__(self, worker, log: list[tuple[str, int]]) -> None:
        self.worker = worker
        self.log = log

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        self.log.append(("submit", plan.step_id))
        future = self.worker.submit_step(plan)
        log = self.log

        class Logged:
            def result(self, timeout=None):
                log.append(("result", plan.step_id))
                return future.result(timeout)

        return Logged()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_async_scheduling_sends_the_next_step_before_taking_a_result(llama_dir,
                                                                     async_scheduling):
    engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    log: list[tuple[str, int]] = []
    engine.core.workers = [RecordingWorker(engine.core.workers[0], log)]
    generate(engine, prompts(0, [13, 29]))
    decode_steps = list(dict.fromkeys(step_id for event, step_id in log if event == "result"))
    decode_steps = decode_steps[1:-1]
    for n in decode_steps:
        submitted_next, taken = log.index(("submit", n + 1)), log.index(("result", n))
        assert (submitted_next < taken) == async_scheduling, log


STOPPING = SamplingParams(temperature=1.0, seed=11, max_tokens=24,
                          stop_token_ids=list(range(3, 256, 9)))  # sequences end at random steps


@pytest.mark.parametrize("sampling", [
    STOPPING,
    SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16,
                   stop_token_ids=list(range(3, 256, 9))),
    SamplingParams(n=1, best_of=3, temperature=1.0, seed=4, max_tokens=10),
    SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1),
], ids=["stop_tokens", "n3", "best_of3", "beam2", "logprobs"])
def test_async_scheduling_matches_one_step_at_a_time(llama_dir, sampling):
    batch = prompts(4, [11, 19, 6, 25])
    sync = make_engine(llama_dir, async_scheduling=False, max_num_batched_tokens=16)
    expected = all_outputs(sync, batch, sampling)
    engine = make_engine(llama_dir, max_num_batched_tokens=16, num_gpu_blocks_override=16)
    assert all_outputs(engine, batch, sampling) == expected
    assert_all_blocks_free(engine)


def test_aborts_and_stops_between_async_steps_drop_the_in_flight_results(llama_dir):
    engine = make_engine(llama_dir)
    for i, ids in enumerate(prompts(5, [9, 14, 20])):
        engine.add_request(f"r{i}", ids, GREEDY)
    tokens = {"r0": []}
    for _ in range(4):
        for report in engine.step():
            tokens[report.request_id] = tokens.get(report.request_id, []) + (
                report.outputs[0].token_ids)
    assert engine.core.has_step_in_flight  # r0..r2's next step is running
    aborted = engine.abort_request("r1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    stopped = engine.finish_sequence("r2", 0)
    assert stopped is not None and stopped.outputs[0].finish_reason == "stop"
    while engine.has_unfinished_requests():
        for report in engine.step():
            assert report.request_id == "r0", report
            tokens["r0"] += report.outputs[0].token_ids
    assert len(tokens["r0"]) == GREEDY.max_tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_finished_output_stops_running_and_frees_its_blocks_while_its_sibling_goes_on(
        llama_dir, async_scheduling):
    engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    steps = ScheduledSteps(engine.core)
    sampling = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    engine.add_request("r", prompts(6, [10])[0], sampling)
    tokens = {0: [], 1: []}
    finish = {}
    while engine.has_unfinished_requests():
        reports = engine.step()
        if len(tokens[0]) >= 3 and not finish:
            final = engine.finish_sequence("r", 0)
            assert final is None  # output 1 still runs
            finish["done"] = True
        for report in reports:
            for output in report.outputs:
                tokens[output.index] += output.token_ids
    assert len(tokens[1]) == sampling.max_tokens
    assert len(tokens[0]) < 8, tokens  # what the steps in flight at the finish still sampled
    steps.assert_finished_early("r", finished=0, sibling=1, min_steps_after=12)
    assert_all_blocks_free(engine)
    with pytest.raises(NotFound, match="'r'"):
        engine.finish_sequence("r", 1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(n=1, best_of=3, temperature=1.0, seed=4, max_tokens=10),
    SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=10),
], ids=["best_of3", "beam2"])
def test_ranked_outputs_cannot_be_finished_one_by_one(llama_dir, sampling):
    engine = make_engine(llama_dir)
    engine.add_request("r", prompts(6, [10])[0], sampling)
    engine.step()
    with pytest.raises(InvalidRequest, match="best_of > n"):
        engine.finish_sequence("r", 0)
    engine.abort_request("r")
    assert_all_blocks_free(engine)
