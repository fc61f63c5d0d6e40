"""Tiny random-weight models built from transformers configs, saved as HF folders.

HF transformers runs the same weights as the reference, so every parity test needs no download.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from tests.unit.tiny_tokenizers import byte_level_bpe

ARCHITECTURES = ("llama", "qwen2", "qwen3", "opt")

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "llama":
        return transformers.LlamaConfig(**_COMMON, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**_COMMON, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**_COMMON, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=False)
    if arch == "opt":
        return transformers.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                      ffn_dim=128, num_attention_heads=4,
                                      max_position_embeddings=512, word_embed_proj_dim=64,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def make_tiny_model(arch: str, path: Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Random weights (std large enough that greedy decoding does not collapse), saved to path."""
    config = tiny_config(arch)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def make_served_model(path: Path, vocab_size: int = 512) -> Path:
    """A tiny Llama with a real (tiny, byte-level BPE) tokenizer and a chat template, so a
    gateway can serve it and grammars compile against it: vocab 512 covers its 400 ids."""
    make_tiny_model("llama", path, vocab_size=vocab_size)
    byte_level_bpe().hf_tokenizer.save_pretrained(path)
    return Path(path)


def split_tokenizer(model_dir: Path, root: Path) -> tuple[Path, Path]:
    """model_dir's config and weights in root/model, its tokenizer files in root/tokenizer: a
    model folder without a tokenizer, served with --tokenizer."""
    model, tokenizer = root / "model", root / "tokenizer"
    model.mkdir(parents=True)
    tokenizer.mkdir(parents=True)
    for path in Path(model_dir).iterdir():
        is_model_file = path.name in ("config.json", "generation_config.json") or \
            path.suffix == ".safetensors"
        shutil.copy(path, (model if is_model_file else tokenizer) / path.name)
    return model, tokenizer


def load_hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager").eval()
