"""Model variants beyond the default tiny configs: rope scalings, biases, OPT's projections and
post-norm layers, pytorch_model.bin checkpoints. Each must match HF on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.integration.worker_driver import Driver, assert_matches_hf, make_worker
from tests.tiny_models import _COMMON, load_hf

PROMPT = [9, 40, 7, 120, 33, 250, 18, 64, 5, 91, 17, 3, 201]


def _build(config: transformers.PretrainedConfig, path, safe: bool = True):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if not safe:  # transformers v5 only writes safetensors: convert to the legacy format
        for file in path.glob("*.safetensors"):
            file.unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def _llama(**kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**_COMMON, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, **kw)


VARIANTS = {
    "llama3_rope": lambda: _llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear_rope": lambda: _llama(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama_biases_tied": lambda: _llama(attention_bias=True, mlp_bias=True,
                                        tie_word_embeddings=True),
    "opt_project_in_out": lambda: transformers.OPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2,
        pad_token_id=0),
    "opt_post_norm": lambda: transformers.OPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_hf(tmp_path, variant):
    path = _build(VARIANTS[variant](), tmp_path / variant)
    driver = Driver(make_worker(path))
    driver.add(0, PROMPT)
    driver.step({0: 8})
    driver.run_to_length([0], len(PROMPT) + 12)
    assert_matches_hf(driver, load_hf(path), 0)


def test_pytorch_bin_checkpoint_matches_hf(tmp_path):
    path = _build(_llama(), tmp_path / "bin", safe=False)
    assert not list(path.glob("*.safetensors")) and list(path.glob("pytorch_model*.bin"))
    driver = Driver(make_worker(path, load_format="pt"))
    driver.add(0, PROMPT)
    driver.run_to_length([0], len(PROMPT) + 6)
    assert_matches_hf(driver, load_hf(path), 0)
