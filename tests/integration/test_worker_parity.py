"""The worker's greedy tokens and logits equal HF transformers' on the same weights (fp32, CPU),
alone, in a mixed batch of prefills and decodes, and with chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.worker_driver import Driver, assert_matches_hf, hf_logits, make_worker
from tests.tiny_models import load_hf

NUM_STEPS = 32


def _prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def arch_setup(tiny_model_dir, tiny_arch):
    path = tiny_model_dir(tiny_arch)
    return path, load_hf(path)


def test_single_request_matches_hf(arch_setup):
    path, hf = arch_setup
    driver = Driver(make_worker(path))
    driver.add(0, _prompt(0, 11))
    driver.run_to_length([0], 11 + NUM_STEPS)
    assert_matches_hf(driver, hf, 0)


def test_mixed_batch_matches_hf(arch_setup):
    """Sequences arrive while others decode; a long prompt is chunked next to decodes."""
    path, hf = arch_setup
    driver = Driver(make_worker(path))
    lens = {0: 5, 1: 19, 2: 40, 3: 1}
    for seq_id, n in lens.items():
        driver.add(seq_id, _prompt(seq_id + 10, n))
    driver.step({0: 5})
    driver.step({0: 1, 1: 19})
    driver.step({0: 1, 1: 1, 2: 16})  # first chunk of seq 2 beside two decodes
    driver.step({2: 24, 0: 1, 3: 1, 1: 1})  # last chunk, a one-token prompt, decodes
    driver.run_to_length(list(lens), 40 + 8)
    for seq_id, n in lens.items():
        driver.run_to_length([seq_id], n + NUM_STEPS)
        assert_matches_hf(driver, hf, seq_id)


def test_chunked_prefill_equals_single_prefill(arch_setup):
    path, hf = arch_setup
    prompt = _prompt(7, 37)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=3)
    whole = Driver(make_worker(path))
    whole.add(0, prompt, sampling)
    whole.step({0: 37})
    chunked = Driver(make_worker(path))
    chunked.add(0, prompt, sampling)
    for n in (12, 13, 12):
        chunked.step({0: n})
    # fp32 rounding apart: the chunks' linears take the skinny kernel, the whole prompt's BLAS,
    # each summing in its own order (4-12e-6 of logits ~4.4 in the three models)
    torch.testing.assert_close(chunked.recorder.logits[(0, 36)], whole.recorder.logits[(0, 36)],
                               atol=2e-5, rtol=0)
    assert chunked.seqs[0].token_ids == whole.seqs[0].token_ids
    # prompt logprobs: one entry per prompt token after the first, whichever the chunking
    got, want = chunked.seqs[0].prompt_logprobs, whole.seqs[0].prompt_logprobs
    assert len(got) == len(want) == len(prompt) - 1
    reference = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    for pos, (a, b) in enumerate(zip(got, want, strict=True)):
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert a[0].token_id == prompt[pos + 1]
        assert a[0].logprob == pytest.approx(reference[pos, prompt[pos + 1]].item(), abs=1e-4)
        assert len(a) == 4


@pytest.fixture
def one_thread():
    """Worker(num_threads=1) sets torch's process-wide thread count; put it back afterwards."""
    previous = torch.get_num_threads()
    yield 1
    torch.set_num_threads(previous)


def test_smollm2_greedy_matches_hf(smollm2_dir, one_thread):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain gravity to a child.",
                 "Write a Python function that reverses a string."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for q in questions]
    # one thread: a 2-thread OpenMP region stalls badly on a shared, oversubscribed CPU
    driver = Driver(make_worker(smollm2_dir, num_gpu_blocks=128, block_size=16,
                                num_threads=one_thread))
    for seq_id, prompt in enumerate(prompts):
        driver.add(seq_id, prompt)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    for _ in range(47):
        driver.step({i: 1 for i in range(len(prompts))})
    for seq_id, prompt in enumerate(prompts):
        generated = driver.seqs[seq_id].token_ids[len(prompt):]
        assert len(generated) == 48
        # HF greedy, teacher-forced on our tokens: each of ours must be HF's argmax
        expected = hf_logits(hf, driver.seqs[seq_id].token_ids)[len(prompt) - 1:-1].argmax(-1)
        assert generated == expected.tolist(), questions[seq_id]
    assert "Paris" in tokenizer.decode(driver.seqs[0].token_ids[len(prompts[0]):])
