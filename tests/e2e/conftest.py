from pathlib import Path

import pytest
import torch
import transformers

from tests.tiny_models import tiny_config
from tests.unit.tiny_tokenizers import byte_level_bpe


@pytest.fixture(scope="session")
def tiny_served_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a real (tiny, byte-level BPE) tokenizer and a chat
    template, so the gateway can serve it: vocab 512 covers the tokenizer's 400 ids."""
    return _served_model(tmp_path_factory.mktemp("served") / "tiny-llama", vocab_size=512)


@pytest.fixture(scope="session")
def tiny_odd_vocab_model_dir(tmp_path_factory) -> Path:
    """The same with 510 embedding rows: split over 4 tensor-parallel ranks, the last one holds
    126 rows and 2 of padding."""
    return _served_model(tmp_path_factory.mktemp("served") / "tiny-llama-510", vocab_size=510)


def _served_model(path: Path, vocab_size: int) -> Path:
    config = tiny_config("llama")
    config.vocab_size = vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    byte_level_bpe().hf_tokenizer.save_pretrained(path)
    return path
