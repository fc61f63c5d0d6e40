"""Embedding requests (LLMEngine's is_pooling, LLM.embed): pooled final hidden states equal
Hugging Face's (AutoModel's last_hidden_state, pooled the same way and L2-normalized), whatever
the chunking, batching and prefix cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm import LLM
from pagedserve.llm_engine import LLMEngine

PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 70, [11]]


def hf_embeddings(model_dir, prompts: list[list[int]], pooling_type: str) -> list[torch.Tensor]:
    import transformers

    hf = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]
            vector = hidden.mean(dim=0) if pooling_type == "mean" else hidden[-1]
            vectors.append(F.normalize(vector, dim=0))
    return vectors


OPTIONS = dict(device="cpu", attention_backend="torch", block_size=16,
               num_gpu_blocks_override=64, num_cpu_blocks_override=8, num_threads=1)


def embed(engine: LLMEngine, prompts: list[list[int]], first_id: int = 0) -> list[list[float]]:
    """The tiny models have no tokenizer for LLM: the engine, as LLM.embed drives it."""
    request_ids = [f"e{first_id + i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, prompt, SamplingParams(), is_pooling=True)
    embeddings = {}
    while engine.has_unfinished_requests():
        for report in engine.step():
            if report.finished:
                embeddings[report.request_id] = report.embedding
    return [embeddings[r] for r in request_ids]


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_equal_hf_pooled_hidden_states(tiny_model_dir, tiny_arch, pooling_type):
    model_dir = tiny_model_dir(tiny_arch)
    # a 24-token budget prefills the longer prompts in chunks, beside the short ones
    engine = LLMEngine.from_kwargs(model=str(model_dir), pooling_type=pooling_type,
                                   max_num_batched_tokens=24, enable_prefix_caching=True,
                                   **OPTIONS)
    try:
        outputs = embed(engine, PROMPTS)
        again = embed(engine, PROMPTS[1:3], first_id=10)  # prefix-cache hits for "last"
        load = engine.core.get_load()
    finally:
        engine.close()
    expected = hf_embeddings(model_dir, PROMPTS, pooling_type)
    for out, want in zip(outputs + again, expected + expected[1:3], strict=True):
        got = torch.tensor(out)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert load.num_gpu_blocks_used == 0 and load.num_running == 0


def run(engine: LLMEngine) -> dict[str, tuple[list[int], list[float] | None]]:
    """request_id → (generated tokens, embedding) once every request is done."""
    results: dict[str, tuple[list[int], list[float] | None]] = {}
    while engine.has_unfinished_requests():
        for report in engine.step():
            tokens, _ = results.get(report.request_id, ([], None))
            tokens += [t for o in report.outputs for t in o.token_ids]
            results[report.request_id] = (tokens, report.embedding)
    return results


def test_embeddings_batch_with_generating_requests(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = LLMEngine.from_kwargs(model=str(model_dir), max_num_batched_tokens=32, **OPTIONS)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        engine.add_request("g", PROMPTS[1], greedy)
        engine.add_request("e", PROMPTS[2], SamplingParams(), is_pooling=True)
        together = run(engine)
        engine.add_request("g2", PROMPTS[1], greedy)
        alone = run(engine)
        load = engine.core.get_load()
    finally:
        engine.close()
    assert len(together["g"][0]) == 6 and together["g"][0] == alone["g2"][0]
    assert together["e"][0] == []  # nothing sampled for an embedding request
    torch.testing.assert_close(torch.tensor(together["e"][1]),
                               hf_embeddings(model_dir, [PROMPTS[2]], "last")[0],
                               atol=2e-5, rtol=1e-4)
    assert load.num_gpu_blocks_used == 0


@pytest.mark.slow
def test_default_model_embeddings_equal_hf(smollm2_dir):
    texts = ["The capital of France is Paris.", "def fibonacci(n):"]
    with LLM(str(smollm2_dir), **OPTIONS) as llm:
        outputs = llm.embed(texts, use_tqdm=False)
    expected = hf_embeddings(smollm2_dir, [o.prompt_token_ids for o in outputs], "last")
    assert [o.prompt for o in outputs] == texts
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want,
                                   atol=1e-4, rtol=1e-3)


def test_a_mean_pooled_prompt_preempted_mid_prefill_is_recomputed_whole(tiny_model_dir):
    """Its running sum lives in the worker's mirror: a preemption (even under preemption_mode
    swap) recomputes the prompt from its first token."""
    model_dir = tiny_model_dir("llama")
    long_prompt = [(7 * i) % 250 + 3 for i in range(150)]
    engine = LLMEngine.from_kwargs(
        model=str(model_dir), pooling_type="mean", max_num_batched_tokens=4,
        preemption_mode="swap", **{**OPTIONS, "num_gpu_blocks_override": 14})
    try:
        # the generation's decode outgrows the pool while the embedding is half prefilled
        engine.add_request("g", list(range(3, 40)), SamplingParams(
            temperature=0.0, max_tokens=100, ignore_eos=True))
        engine.step()
        engine.add_request("e", long_prompt, SamplingParams(), is_pooling=True)
        results = run(engine)
        num_preemptions = engine.core.get_load().num_preemptions
    finally:
        engine.close()
    assert num_preemptions > 0
    assert len(results["g"][0]) == 100
    torch.testing.assert_close(torch.tensor(results["e"][1]),
                               hf_embeddings(model_dir, [long_prompt], "mean")[0],
                               atol=2e-5, rtol=1e-4)
