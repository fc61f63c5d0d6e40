"""LLM.generate / LLM.chat on SmolLM2-135M-Instruct against Hugging Face transformers."""

from __future__ import annotations

import gc

import pytest
import torch
from pagedserve.services.common.gc_tuning import GEN0_THRESHOLD
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm import LLM
from tests.scheduled_steps import ScheduledSteps, stop_string

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "List three prime numbers.",
             "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    # one thread: the CPU test machines are shared, and oversubscription costs more than it gains
    return LLM(str(smollm2_dir), device="cpu", attention_backend="torch", block_size=16,
               num_gpu_blocks_override=256, num_cpu_blocks_override=64, num_threads=1)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(llm) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in QUESTIONS]


def hf_generate(hf, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
    generated = out[0, len(prompt):].tolist()
    eos = hf.generation_config.eos_token_id
    return generated[:generated.index(eos) + 1] if eos in generated else generated


def test_greedy_batch_equals_hf_greedy(llm, hf):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    sampling = SamplingParams(temperature=0.0, max_tokens=10)
    outputs = llm.generate(texts, sampling, use_tqdm=False)
    assert [o.prompt for o in outputs] == texts
    for text, out in zip(texts, outputs, strict=True):
        completion, = out.outputs
        assert completion.token_ids == hf_generate(hf, out.prompt_token_ids, 10), text
        assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_a_stop_string_ends_its_output_in_the_engine_while_its_sibling_goes_on(llm):
    sampling = {"n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 40, "ignore_eos": True}
    free, = llm.generate("Once upon a time", SamplingParams(**sampling), use_tqdm=False)
    stop = stop_string([c.text for c in free.outputs])
    steps = ScheduledSteps(llm.engine.core)
    out, = llm.generate("Once upon a time", SamplingParams(stop=[stop], **sampling),
                        use_tqdm=False)
    first, second = out.outputs
    assert (first.text, first.finish_reason) == ("", "stop")
    assert second.token_ids == free.outputs[1].token_ids
    steps.assert_finished_early(out.request_id, finished=0, sibling=1, min_steps_after=20)
    assert llm.engine.get_load().num_gpu_blocks_used == 0


def test_chat_answers_paris(llm):
    out, = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


def test_stop_string_cuts_the_text_and_reports_stop(llm):
    out, = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=16, stop=["Paris"]),
                    use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert "Paris" not in completion.text and completion.text.endswith("is ")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_load().num_gpu_blocks_used == 0


def test_seeded_n4_is_reproducible_and_outputs_differ(llm, chat_prompts):
    sampling = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=6)
    first, = llm.generate([chat_prompts[2]], sampling, use_tqdm=False)
    second, = llm.generate([chat_prompts[2]], sampling, use_tqdm=False)
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert tokens == [c.token_ids for c in second.outputs]
    assert len({tuple(t) for t in tokens}) > 1
    other, = llm.generate([chat_prompts[2]], SamplingParams(n=4, temperature=1.0, seed=99,
                                                            max_tokens=6), use_tqdm=False)
    assert [c.token_ids for c in other.outputs] != tokens


def test_beam_search_matches_hf_num_beams(llm, hf, chat_prompts):
    # Our stopping rule is HF's default (early_stopping=False): stop once beam_width beams have
    # finished and the best live beam, scored at its current length, cannot beat the worst of
    # them; scores are cum_logprob / num_generated_tokens ** length_penalty.
    sampling = SamplingParams(n=1, best_of=4, use_beam_search=True, temperature=0.0,
                              max_tokens=10)
    outputs = llm.generate(chat_prompts, sampling, use_tqdm=False)
    for prompt, out in zip(chat_prompts, outputs, strict=True):
        best, = out.outputs
        expected = hf_generate(hf, prompt, 10, num_beams=4, early_stopping=False,
                               length_penalty=1.0)
        assert best.token_ids == expected, llm.tokenizer.decode(expected)
    assert llm.engine.get_load().num_gpu_blocks_used == 0


def test_generate_steps_with_the_collector_thresholds_raised_and_restores_them(llm, monkeypatch):
    """A full collection over everything alive ran every ~40 steps of a 256-stream batch with
    CPython's defaults (~250 ms each on the simulated H100's workload)."""
    seen = []
    step = llm.engine.step

    def spying_step():
        seen.append(gc.get_threshold())
        return step()

    monkeypatch.setattr(llm.engine, "step", spying_step)
    before = gc.get_threshold()
    llm.generate("Once upon a time", SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and all(t[0] == max(GEN0_THRESHOLD, before[0]) for t in seen)
    assert gc.get_threshold() == before
