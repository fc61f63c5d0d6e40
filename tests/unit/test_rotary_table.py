"""Every decoder layer turns query and key by the same positions, so a model holds one rotary
table, not one a layer (num_layers x max_position x head_size floats each)."""

import pytest
import torch
from pagedserve.kernels.backend import get_backend
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.models.registry import get_model_class

from tests.tiny_models import tiny_config


@pytest.mark.parametrize("arch, architecture", [
    ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_the_layers_share_one_rotary_table(arch, architecture):
    config = tiny_config(arch)
    config.num_hidden_layers = 3
    model = get_model_class([architecture])(
        config, get_backend("torch", torch.device("cpu")), max_position=256)
    tables = {id(m.rotary_emb.cos_sin_cache) for m in model.modules() if isinstance(m, Attention)}
    assert len(tables) == 1
    head_size = getattr(config, "head_dim", None) or 64 // 4
    assert sum(b.numel() for b in model.buffers()) == 256 * head_size  # buffers() dedups
