"""Tensor-parallel sharding on one process: each rank's layers load its slice of the checkpoint
(heads and MLP columns in the column-parallel layers, the matching input columns in the
row-parallel ones, vocabulary rows in the embeddings), and sizes that do not split are refused
by name.
The forward across ranks (all-reduce, sampled-token broadcast) runs in
tests/e2e/test_processes.py with two worker processes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pagedserve.kernels.backend import get_backend
from pagedserve.scheduler_svc.servicer import start_engine
from pagedserve.services.common.config import (
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerServiceConfig,
)
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import SampledSequence
from pagedserve.worker_svc.layers.linear import VocabEmbedding, kv_heads_of_rank
from pagedserve.worker_svc.loader import load_hf_config, load_model
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel

from tests.tiny_models import load_hf

CPU = torch.device("cpu")


def _load(path, tp: TensorParallel):
    return load_model(ModelConfig(model=str(path)), load_hf_config(str(path)), torch.float32, CPU,
                      backend=get_backend("torch", CPU), max_position=512, tp=tp)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_each_rank_loads_its_slice_and_the_slices_make_the_whole(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    hf = load_hf(path).state_dict()
    attn = "self_attn"
    if arch == "opt":
        prefix, out, up, down = "model.decoder.layers.0.", "self_attn.out_proj", "fc1", "fc2"
    else:
        prefix, out, up, down = ("model.layers.0.", "self_attn.o_proj", "mlp.up_proj",
                                 "mlp.down_proj")
    ranks = [_load(path, TensorParallel(rank, 2)) for rank in range(2)]
    params = [dict(m.named_parameters()) for m in ranks]
    for part in ("q", "k", "v"):
        full = hf[f"{prefix}{attn}.{part}_proj.weight"]
        layers = [m.get_submodule(f"{prefix}{attn}.qkv_proj") for m in ranks]
        shards = [p[f"{prefix}{attn}.qkv_proj.weight"].narrow(0, *layer.shard_parts[part][:2])
                  for p, layer in zip(params, layers, strict=True)]
        torch.testing.assert_close(torch.cat(shards, 0), full)
    up_shards = [p[f"{prefix}{'mlp.gate_up_proj' if arch != 'opt' else up}.weight"]
                 for p in params]
    if arch != "opt":
        up_shards = [w.narrow(0, w.shape[0] // 2, w.shape[0] // 2) for w in up_shards]
    torch.testing.assert_close(torch.cat(up_shards, 0), hf[f"{prefix}{up}.weight"])
    for name in (out, down):  # row-parallel: input columns split, bias whole
        torch.testing.assert_close(
            torch.cat([p[f"{prefix}{name}.weight"] for p in params], 1),
            hf[f"{prefix}{name}.weight"])
        if f"{prefix}{name}.bias" in hf:
            for p in params:
                torch.testing.assert_close(p[f"{prefix}{name}.bias"], hf[f"{prefix}{name}.bias"])
    embed = "model.decoder.embed_tokens.weight" if arch == "opt" else "model.embed_tokens.weight"
    torch.testing.assert_close(torch.cat([p[embed] for p in params], 0), hf[embed])  # by rows


def test_sizes_that_do_not_split_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by "
                                          "tensor_parallel_size=3"):
        _load(tiny_model_dir("llama"), TensorParallel(0, 3))


def test_one_rank_needs_no_group():
    sampled = [SampledSequence(seq_id=3, token_ids=[7], logprobs=[-0.5])]
    assert SINGLE.broadcast_samples(sampled, [3], CPU) is sampled
    x = torch.ones(2)
    assert SINGLE.all_reduce(x) is x and x.tolist() == [1.0, 1.0]


def test_a_short_address_list_is_refused():
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="worker_addresses has 1 addresses; "
                                          "tensor_parallel_size=2 needs one per rank"):
        asyncio.run(start_engine(config, SchedulerServiceConfig(
            worker_addresses=["127.0.0.1:1"])))


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head_on_the_ranks_that_read_it(
        tiny_model_dir):
    path = tiny_model_dir("llama")  # 4 query heads, 2 KV heads of 16
    hf = load_hf(path).state_dict()
    prefix = "model.layers.0.self_attn."
    ranks = [_load(path, TensorParallel(rank, 4)) for rank in range(4)]
    for rank, model in enumerate(ranks):
        attn = model.get_submodule(prefix.rstrip("."))
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        weight = dict(model.named_parameters())[f"{prefix}qkv_proj.weight"]
        layer = attn.qkv_proj
        kv_head = rank // 2  # query heads 0, 1 read KV head 0; 2, 3 read KV head 1
        for part in ("k", "v"):
            torch.testing.assert_close(weight.narrow(0, *layer.shard_parts[part][:2]),
                                       hf[f"{prefix}{part}_proj.weight"][16 * kv_head:][:16])
        torch.testing.assert_close(weight.narrow(0, *layer.shard_parts["q"][:2]),
                                   hf[f"{prefix}q_proj.weight"][16 * rank:][:16])
    with pytest.raises(ConfigError, match="num_key_value_heads=2 and tensor_parallel_size=3"):
        kv_heads_of_rank(2, TensorParallel(0, 3))


def test_a_vocabulary_that_does_not_split_evenly_is_padded_on_the_last_rank():
    table = torch.arange(15, dtype=torch.float32).view(5, 3)
    first, last = VocabEmbedding(5, 3, TensorParallel(0, 2)), VocabEmbedding(5, 3,
                                                                           TensorParallel(1, 2))
    for layer in (first, last):
        layer.weight.weight_loader(layer.weight, table)
    assert (first.vocab_start, first.vocab_end, last.vocab_start, last.vocab_end) == (0, 3, 3, 5)
    torch.testing.assert_close(first.weight, table[:3])
    torch.testing.assert_close(last.weight, torch.cat([table[3:], torch.zeros(1, 3)]))
