from __future__ import annotations

import importlib

from pagedserve.services.common.errors import ConfigError
from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedserve.worker_svc.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedserve.worker_svc.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedserve.worker_svc.models.llama", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("pagedserve.worker_svc.models.opt", "OPTForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    module, name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module), name)


def resolve_architecture(architectures: list[str]) -> str:
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ConfigError(f"model architectures {architectures} are not supported; "
                      f"supported: {supported_architectures()}")
