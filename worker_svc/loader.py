"""Weight loading: checkpoint tensors streamed one at a time into the model's fused parameters."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from pagedserve.services.common.config import ModelConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.layers.linear import default_weight_loader
from pagedserve.worker_svc.models.registry import get_model_class
from torch import nn

logger = logging.getLogger(__name__)

# (fused parameter name part, checkpoint name part, shard id), vLLM's stacked_params_mapping
StackedParamsMapping = list[tuple[str, str, str | int]]


def load_hf_config(model_dir: str) -> transformers.PretrainedConfig:
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ConfigError(f"model must be a folder with a config.json, got {model_dir!r}")
    return transformers.AutoConfig.from_pretrained(path)


def eos_token_ids(model_dir: str, hf_config: transformers.PretrainedConfig) -> list[int]:
    """config.json's and generation_config.json's, in first-seen order."""
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token_id in (value if isinstance(value, list) else [value]):
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created inside are of `dtype` unless they say otherwise."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_weights(model_dir: str, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    path = Path(model_dir)
    st_files = sorted(path.glob("*.safetensors"))
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if load_format in ("auto", "safetensors") and st_files:
        from safetensors import safe_open

        for file in st_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    if load_format in ("auto", "pt") and bin_files:
        for file in bin_files:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state
        return
    raise ConfigError(f"no {load_format} weights found in model folder {model_dir!r} "
                      "(expected *.safetensors or pytorch_model*.bin)")


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       stacked_params_mapping: StackedParamsMapping,
                       skip_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Returns the names of the parameters that received data; `skip_prefixes` is e.g. a tied
    lm_head."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip_prefixes):
            continue
        for param_part, weight_part, shard_id in stacked_params_mapping:
            if weight_part not in name:
                continue
            fused = name.replace(weight_part, param_part)
            if fused in params:
                params[fused].weight_loader(params[fused], tensor, shard_id)
                loaded.add(fused)
                break
        else:
            if name not in params:
                logger.debug("checkpoint tensor %s has no parameter; skipped", name)
                continue
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    return loaded


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """vLLM's dummy weights, drawn on the parameters' device: a CPU generator would take minutes
    for a 7B model."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            param.data.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.uniform_(-1e-3, 1e-3, generator=generators[param.device])


def load_model(model_config: ModelConfig, hf_config: transformers.PretrainedConfig,
               dtype: torch.dtype, device: torch.device, **model_kwargs: Any) -> nn.Module:
    model_class = get_model_class(getattr(hf_config, "architectures", None) or [])
    with default_dtype(dtype), torch.device(device):
        model = model_class(hf_config, **model_kwargs)
    if model_config.load_format == "dummy":
        _fill_dummy(model, model_config.seed)
    else:
        loaded = model.load_weights(iterate_weights(model_config.model, model_config.load_format))
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            raise ConfigError(f"checkpoint in {model_config.model!r} lacks weights for "
                              f"{missing[:5]}{' …' if len(missing) > 5 else ''}")
    return model.eval()
