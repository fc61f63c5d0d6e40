"""The real default model through all three services: greedy answers equal Hugging Face's and
the in-process LLM's (the gRPC split adds transport, never logic)."""

import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.llm import LLM
from tests.e2e.stack import tiny_config

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), device="cpu", kv_cache_memory_gib=0.1,
               swap_space_gib=0.05)


@pytest.fixture(scope="module")
def stack_config(smollm2_dir):
    return tiny_config(smollm2_dir, kv_cache_memory_gib=0.1, swap_space_gib=0.05)


def hf_greedy(hf, prompt_text: str) -> tuple[list[int], list[int], str]:
    """(prompt ids, output ids, output text) of HF's greedy generate, EOS included."""
    tokenizer, model = hf
    input_ids = tokenizer(prompt_text, return_tensors="pt").input_ids  # [1, num_prompt_tokens]
    with torch.inference_mode():
        output = model.generate(input_ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    output_ids = output[0, input_ids.shape[1]:].tolist()
    return (input_ids[0].tolist(), output_ids,
            tokenizer.decode(output_ids, skip_special_tokens=True))


def greedy(**sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **sampling)


def test_chat_answer_equals_hugging_face_and_llm(generation, hf, llm):
    tokenizer, _ = hf
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                add_generation_prompt=True, tokenize=False)
    prompt_ids, expected_ids, expected_text = hf_greedy(hf, prompt_text)
    response = generation.Generate(gateway_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content=QUESTION)]),
        sampling=greedy()), timeout=120)
    (output,) = response.outputs
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert list(output.token_ids) == expected_ids
    assert output.text == expected_text
    assert "Paris" in output.text
    (in_process,) = llm.chat([{"role": "user", "content": QUESTION}],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                             use_tqdm=False)
    assert in_process.outputs[0].token_ids == expected_ids
    assert in_process.outputs[0].text == output.text


def test_text_completion_stream_equals_hugging_face_and_llm(generation, hf, llm):
    _, expected_ids, expected_text = hf_greedy(hf, PROMPT)
    deltas = list(generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        text=PROMPT, sampling=greedy()), timeout=120))
    assert [t for d in deltas for t in d.token_ids] == expected_ids
    assert "".join(d.text for d in deltas) == expected_text
    (in_process,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                 use_tqdm=False)
    assert in_process.outputs[0].token_ids == expected_ids
    assert in_process.outputs[0].text == expected_text
