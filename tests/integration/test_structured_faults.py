"""Constrained outputs (a JSON schema and a regex, greedy and seeded, n=2, beam search) are
token-exact under what moves a sequence: swap and recompute preemption, the scheduler planning
ahead, the worker launching a step before the one in flight is finished, and a request resumed
with the outputs a gateway already streamed (its failover). A tiny random-weight Llama with a
real tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, RunningSequence, StepPlan
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.worker_svc.grammar_cache import GrammarCache

from pagedserve.llm import LLM
from pagedserve.llm_engine import LLMEngine
from tests import tiny_models
from tests.integration.worker_driver import make_worker

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 8},
    "n": {"type": "integer", "minimum": 0}},
    "required": ["name", "tags", "n"], "additionalProperties": False}
REGEX = r"([a-z]{2,9} [0-9]{1,3}\. ){2,12}"
CONSTRAINTS = {"json": StructuredOutputsParams(json_schema=SCHEMA),
               "regex": StructuredOutputsParams(regex=REGEX)}
SAMPLINGS = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
             for c in CONSTRAINTS.values()] + [
    SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=c)
    for c in CONSTRAINTS.values()] + [
    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40,
                   structured_outputs=CONSTRAINTS["json"]),
    SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=40,
                   structured_outputs=CONSTRAINTS["regex"])]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """vocab 512 covers the tokenizer's 400 ids, which the grammars are compiled against."""
    return tiny_models.make_served_model(tmp_path_factory.mktemp("constrained") / "tiny-llama")


def _generate(model_dir, num_gpu_blocks: int, **kw) -> tuple[list, int]:
    """Every prompt with every sampling in one batch; and how many preemptions there were."""
    with LLM(str(model_dir), device="cpu", attention_backend="torch", num_threads=1,
             block_size=BLOCK_SIZE, num_gpu_blocks_override=num_gpu_blocks,
             num_cpu_blocks_override=64, **kw) as llm:
        outputs = llm.generate([p for p in PROMPTS for _ in SAMPLINGS],
                               [s for _ in PROMPTS for s in SAMPLINGS], use_tqdm=False)
        num_preemptions = llm.engine.core.scheduler.num_preemptions
    return [[(c.index, c.token_ids, c.finish_reason) for c in out.outputs]
            for out in outputs], num_preemptions


@pytest.fixture(scope="module")
def one_at_a_time(model_dir):
    """Room for every sequence, steps run one at a time: the undisturbed outputs."""
    outputs, num_preemptions = _generate(model_dir, 128, async_scheduling=False)
    assert num_preemptions == 0
    assert any(len(tokens) > 16 for out in outputs for _, tokens, _ in out)
    return outputs


@pytest.mark.parametrize(("num_gpu_blocks", "kw"), [
    (128, {}),
    (16, {"preemption_mode": "swap"}),
    (16, {"preemption_mode": "recompute"}),
], ids=["run_ahead", "swap", "recompute"])
def test_constrained_outputs_are_those_of_an_undisturbed_run(model_dir, one_at_a_time,
                                                             num_gpu_blocks, kw):
    outputs, num_preemptions = _generate(model_dir, num_gpu_blocks, **kw)
    assert outputs == one_at_a_time
    assert (num_preemptions > 0) == ("preemption_mode" in kw)


def test_grammars_compile_against_the_tokenizer_flag(model_dir, one_at_a_time, tmp_path):
    """A model folder without a tokenizer, served with --tokenizer: the worker's grammars use
    that tokenizer, so the constrained outputs are those of the folder that has both."""
    weights, tokenizer = tiny_models.split_tokenizer(model_dir, tmp_path)
    outputs, _ = _generate(weights, 128, tokenizer=str(tokenizer), async_scheduling=False)
    assert outputs == one_at_a_time


def test_a_resumed_constrained_request_continues_token_identically(model_dir, one_at_a_time):
    """What the scheduler a gateway fails over to is given: the outputs already streamed."""
    with LLM(str(model_dir), device="cpu", attention_backend="torch", num_threads=1,
             block_size=BLOCK_SIZE, num_gpu_blocks_override=128,
             num_cpu_blocks_override=8) as llm:
        engine = llm.engine
        for i, sampling in enumerate(SAMPLINGS):
            if sampling.use_beam_search:
                continue  # reports its outputs at the end: nothing streamed to resume from
            expected = {index: tokens for index, tokens, _ in one_at_a_time[i]}
            for cut in (1, 7):
                resumed = {index: tokens[:cut] for index, tokens in expected.items()
                           if len(tokens) > cut}
                engine.core.add_request(f"r{i}-{cut}", PROMPTS[0], sampling, resumed=resumed)
                got = {index: list(tokens) for index, tokens in resumed.items()}
                while engine.has_unfinished_requests():
                    for report in engine.step():
                        for out in report.outputs:
                            got[out.index].extend(out.token_ids)
                assert got == {index: expected[index] for index in resumed}, (i, cut)


def _plans(samplings: list[SamplingParams], num_steps: int) -> list[StepPlan]:
    num_blocks = -(-(len(PROMPTS[1]) + num_steps + 1) // BLOCK_SIZE)
    new_seqs = [NewSequence(seq_id=i, request_id=f"r{i}", token_ids=list(PROMPTS[1]),
                            prompt_len=len(PROMPTS[1]),
                            block_ids=list(range(i * num_blocks, (i + 1) * num_blocks)),
                            num_computed_tokens=0, num_scheduled_tokens=len(PROMPTS[1]),
                            sampling=sampling, seed=1234 + i)
                for i, sampling in enumerate(samplings)]
    plans = [StepPlan(1, 1, new_seqs=new_seqs)]
    for step_id in range(2, num_steps + 2):
        plans.append(StepPlan(1, step_id, previous_step_id=step_id - 1, running_seqs=[
            RunningSequence(i, [], num_blocks, [], 1) for i in range(len(samplings))]))
    return plans


def test_steps_launched_ahead_mask_with_the_tokens_of_the_step_before(model_dir):
    """The worker's run-ahead: step n+1 is launched before step n is finished, and its mask is
    built once step n's draws reached the mirror (the CPU worker driven as the CUDA one runs)."""
    samplings = [dataclasses.replace(s, ignore_eos=True) for s in SAMPLINGS if s.n == 1]
    plans = _plans(samplings, 24)
    reference = make_worker(model_dir, block_size=BLOCK_SIZE)
    expected = [list(reference.execute_step(plan).sampled_by_seq().values()) for plan in plans]
    worker = make_worker(model_dir, block_size=BLOCK_SIZE)
    in_flight = worker.launch_step(plans[0])
    worker.sample_step(in_flight)
    outputs = []
    for plan in plans[1:]:
        ahead = worker.launch_step(plan, ahead_of=in_flight)
        outputs.append(list(worker.finish_step(in_flight).sampled_by_seq().values()))
        worker.sample_step(ahead)
        in_flight = ahead
    outputs.append(list(worker.finish_step(in_flight).sampled_by_seq().values()))
    assert [[(s.seq_id, s.token_ids) for s in out] for out in outputs] == \
        [[(s.seq_id, s.token_ids) for s in out] for out in expected]
    assert len(worker.runner.grammars) == len(samplings)


def test_a_steps_timings_carry_its_wait_for_the_mask(model_dir):
    """mask_ns (of sample_ns, in the worker step's trace span): what a step's draws waited for
    its constrained rows' bitmask; nothing for a step without constrained rows."""
    constrained = [dataclasses.replace(s, ignore_eos=True) for s in SAMPLINGS if s.n == 1]
    free = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    for samplings, is_constrained in ((constrained, True), (free, False)):
        worker = make_worker(model_dir, block_size=BLOCK_SIZE)
        for plan in _plans(samplings, 3):
            timings = worker.execute_step(plan).timings
            assert (timings.mask_ns > 0) is is_constrained
            assert timings.mask_ns <= timings.sample_ns


COMPILE_S = 1.0  # a grammar's compile, made slow


@pytest.fixture()
def slow_compiles(monkeypatch):
    compile_grammar = GrammarCache._compile

    def slow(self, params):
        time.sleep(COMPILE_S)
        return compile_grammar(self, params)

    monkeypatch.setattr(GrammarCache, "_compile", slow)


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_kwargs(model=str(model_dir), device="cpu", attention_backend="torch",
                                 num_threads=1, block_size=BLOCK_SIZE)


FREE = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def test_a_constrained_request_is_added_once_compiled_and_no_step_waits(model_dir,
                                                                         slow_compiles):
    with _engine(model_dir) as engine:
        engine.add_request("free", PROMPTS[0], FREE)
        for _ in range(3):
            engine.step()
        start = time.perf_counter()
        engine.add_request("constrained", PROMPTS[1], SAMPLINGS[0])
        assert time.perf_counter() - start >= COMPILE_S  # compiled by the worker first
        slowest_s = 0.0
        while engine.core.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            slowest_s = max(slowest_s, time.perf_counter() - start)
    assert slowest_s < COMPILE_S / 2


def test_the_scheduler_holds_a_constrained_request_back_while_others_stream(model_dir,
                                                                             slow_compiles):
    """The scheduler service's engine: the request waits for its compile on the event loop,
    beside the steps of the requests already running."""
    engine = _engine(model_dir)

    async def run() -> tuple[float, list[float]]:
        async_engine = await AsyncEngine.start(lambda: engine.core, stop_timeout_s=10.0)
        free, constrained = asyncio.Queue(), asyncio.Queue()
        await async_engine.submit(SubmitRequest("free", PROMPTS[0], FREE), free)
        await free.get()
        submitted = asyncio.get_running_loop().time()
        submit = asyncio.create_task(async_engine.submit(
            SubmitRequest("constrained", PROMPTS[1], SAMPLINGS[0]), constrained))
        arrivals = []
        while not (await free.get()).finished:
            arrivals.append(asyncio.get_running_loop().time())
        await submit
        await constrained.get()
        first_token_s = asyncio.get_running_loop().time() - submitted
        await async_engine.stop()
        return first_token_s, arrivals

    try:
        first_token_s, arrivals = asyncio.run(run())
    finally:
        engine.close()
    assert first_token_s >= COMPILE_S
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < COMPILE_S / 2, gaps
