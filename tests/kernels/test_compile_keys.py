"""No Triton kernel compiles after warm-up: every launch a realistic step makes (1..300 sequences,
contexts up to 32k, prefills of 1..4096 tokens beside decodes, graph captures at their bounds)
has the compile key of a launch the warm-up steps make (`triton_ops.warm_up_batches`). A new key
is a JIT compile in the middle of serving: hundreds of ms to seconds of a stalled step on a GPU.

Keys come from Triton's own argument binder (`triton_aot.compile_key`), which needs no GPU and no
compiler, so this runs under TRITON_INTERPRET=1 too."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import triton_layer_ops, triton_ops  # noqa: E402
from pagedserve.kernels.metadata import AttentionMetadata  # noqa: E402
from pagedserve.kernels.triton_aot import ARCHS, compile_key, step_metadata  # noqa: E402
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN, DecodeBuffers  # noqa: E402
from pagedserve.worker_svc.graph_buckets import (  # noqa: E402
    capture_batch_sizes,
    capture_num_tokens,
    mixed_num_seqs,
)
from pagedserve.worker_svc.mixed_graphs import MixedBuffers  # noqa: E402

MAX_MODEL_LEN = 32768
# (num_heads, num_kv_heads, head_size, hidden, intermediate): Qwen2.5-0.5B, Llama-3-8B
MODELS = {"qwen2.5-0.5b": (14, 2, 64, 896, 4864), "llama-3-8b": (32, 8, 128, 4096, 14336)}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
NUM_CACHE_BLOCKS = 4  # the kernels' keys do not depend on the cache's size
MAX_NUM_SEQS = 256
MAX_GRAPH_TOKENS = 512

DECODE_CONTEXTS = (1, 2, 15, 16, 17, 100, 511, 512, 513, 1000, 1024, 2047, 4095, 8192, 8193,
                   16384, 32767)
NUM_DECODES = (0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 255, 256, 257, 300)
PREFILLS = ((1, 0), (2, 0), (7, 0), (8, 0), (16, 0), (17, 3), (63, 0), (64, 0), (65, 100),
            (512, 0), (1000, 513), (2048, 0), (4095, 1), (4096, 8192))  # (query, context)


def _step(query_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
    """An eager step of these sequences (prefills first)."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    return step_metadata(query_lens, seq_lens, BLOCK_SIZE)


def _step_launches(model: str, arch: int, meta: AttentionMetadata) -> list[triton_ops.Launch]:
    """Every Triton launch of one decoder layer in this step."""
    num_heads, num_kv_heads, head_size, hidden, intermediate = MODELS[model]
    num_tokens = meta.slot_mapping.shape[0]
    kv_cache = torch.empty(2, NUM_CACHE_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size, dtype=DTYPE)
    qkv = torch.empty(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=DTYPE)
    query, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                                   num_kv_heads * head_size], dim=-1)
    heads = torch.empty(num_tokens, num_heads, head_size, dtype=DTYPE)
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    x = torch.empty(num_tokens, hidden, dtype=DTYPE)
    gate_up = torch.empty(num_tokens, 2 * intermediate, dtype=DTYPE)
    launches = [
        triton_layer_ops.rms_norm_launch(torch.empty_like(x), torch.empty_like(x), x,
                                         torch.empty_like(x), torch.empty(hidden, dtype=DTYPE),
                                         1e-6),
        triton_layer_ops.rotary_write_kv_launch(
            heads, positions, query, key, value,
            torch.empty(MAX_MODEL_LEN, head_size, dtype=torch.float32), kv_cache[0],
            kv_cache[1], meta.slot_mapping),
        triton_ops.write_kv_launch(key.unflatten(-1, (num_kv_heads, head_size)),
                                   value.unflatten(-1, (num_kv_heads, head_size)), kv_cache[0],
                                   kv_cache[1], meta.slot_mapping),
        triton_layer_ops.silu_and_mul_launch(torch.empty(num_tokens, intermediate, dtype=DTYPE),
                                             gate_up),
        *triton_ops.attention_launches(torch.empty_like(heads), heads, kv_cache[0], kv_cache[1],
                                       meta, head_size ** -0.5, arch // 10),
    ]
    return launches


def _keys(model: str, arch: int, steps) -> set[tuple]:
    return {compile_key(launch, arch) for meta in steps
            for launch in _step_launches(model, arch, meta)}


def _warm_up_steps() -> list[AttentionMetadata]:
    """The worker's eager warm-up steps (worker_svc/worker.py)."""
    return [_step(q, c) for q, c in [([8, 1], [0, 0]),
                                      *triton_ops.warm_up_batches(MAX_MODEL_LEN)]]


def _graph_captures():
    """The decode and mixed graphs' capture metadata (host fields at their bounds)."""
    max_blocks = MAX_CAPTURE_SEQ_LEN // BLOCK_SIZE
    decode = DecodeBuffers.allocate(MAX_NUM_SEQS, max_blocks, torch.device("cpu"))
    for batch in capture_batch_sizes(MAX_NUM_SEQS):
        yield decode.metadata(batch, MAX_CAPTURE_SEQ_LEN)
    buckets = capture_num_tokens(MAX_GRAPH_TOKENS, MAX_GRAPH_TOKENS)
    mixed = MixedBuffers.allocate(buckets[-1], mixed_num_seqs(buckets[-1], MAX_NUM_SEQS),
                                  max_blocks, torch.device("cpu"))
    for tokens in buckets:
        yield mixed.metadata(tokens, mixed_num_seqs(tokens, MAX_NUM_SEQS), MAX_CAPTURE_SEQ_LEN)


def _serving_steps():
    """Decode-only steps, prefills alone and beside decodes (whose first token is then odd or
    even), and the graph captures."""
    contexts = itertools.cycle(DECODE_CONTEXTS)
    for num_decodes in NUM_DECODES:
        for longest in DECODE_CONTEXTS:
            decodes = [longest] + [next(contexts) % longest for _ in range(num_decodes - 1)]
            if num_decodes:
                yield _step([1] * num_decodes, decodes)
            for query, context in PREFILLS[num_decodes % 3::3]:
                yield _step([query] + [1] * num_decodes, [context] + decodes[:num_decodes])
    yield from _graph_captures()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_serving_compiles_nothing_after_warm_up(model, arch):
    warm = _keys(model, arch, _warm_up_steps())
    serving = _keys(model, arch, _serving_steps())
    new = sorted(serving - warm, key=repr)
    assert not new, (f"{len(new)} compiled variants that warm-up does not make, of kernels "
                     f"{sorted({key[0] for key in new})}; first: {new[0]}")
    assert len(warm) <= 10  # two unified-attention tile shapes, the split pair, the layer ops


def test_warm_up_batches_stay_within_the_model_length():
    assert all(q + c <= 8 for qs, cs in triton_ops.warm_up_batches(8)
               for q, c in zip(qs, cs, strict=True))
    assert len(triton_ops.warm_up_batches(MAX_MODEL_LEN)) == 3
