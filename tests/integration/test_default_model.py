"""The converted default model is a plain HF folder that HF transformers runs as the real chat
model: no quantization config, the chat template included, and it knows the capital of France."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.model_prep import COMPLETE_MARKER, is_prepared, prepare_default_model

pytestmark = pytest.mark.slow


def test_folder_is_a_plain_float32_hf_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert is_prepared(smollm2_dir)


def test_prepare_is_a_no_op_when_complete(smollm2_dir):
    marker = smollm2_dir / COMPLETE_MARKER
    before = (marker.stat().st_mtime_ns, (smollm2_dir / "model.safetensors").stat().st_mtime_ns)
    assert prepare_default_model(smollm2_dir) == smollm2_dir
    after = (marker.stat().st_mtime_ns, (smollm2_dir / "model.safetensors").stat().st_mtime_ns)
    assert after == before


def test_greedy_answer_names_paris(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, num_prompt_tokens]
    with torch.inference_mode():
        output_ids = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output_ids[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
