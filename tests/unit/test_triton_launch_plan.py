"""Which attention kernels a decode batch launches: the split-KV pair for long contexts in a
batch of few (sequence, KV head) programs, the unified kernel alone once the batch fills the
device, as in a CUDA graph whose host lengths are its capture bound."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import triton_ops  # noqa: E402
from pagedserve.kernels.triton_aot import step_metadata  # noqa: E402

BLOCK_SIZE = 16
HEAD_SIZE = 64


def _kernels(num_decodes: int, num_kv_heads: int, context: int) -> list[str]:
    meta = step_metadata([1] * num_decodes, [context] * num_decodes, BLOCK_SIZE)
    kv_cache = torch.empty(2, 4, BLOCK_SIZE, num_kv_heads, HEAD_SIZE, dtype=torch.bfloat16)
    heads = torch.empty(num_decodes, 2 * num_kv_heads, HEAD_SIZE, dtype=torch.bfloat16)
    launches = triton_ops.attention_launches(torch.empty_like(heads), heads, kv_cache[0],
                                             kv_cache[1], meta, HEAD_SIZE ** -0.5, None)
    return [launch.kernel.fn.__name__ for launch in launches]


def test_long_contexts_split_in_a_small_batch_only():
    long = triton_ops.DECODE_PARTITION_SIZE + 1
    assert _kernels(30, 8, long) == ["decode_partition_kernel", "decode_reduce_kernel"]
    assert _kernels(30, 8, long - 1) == ["unified_attention_kernel"]
    many = triton_ops.SPLIT_KV_MAX_PROGRAMS // 8
    assert _kernels(many - 1, 8, 8192) == ["decode_partition_kernel", "decode_reduce_kernel"]
    assert _kernels(many, 8, 8192) == ["unified_attention_kernel"]
    assert _kernels(256, 32, 8192) == ["unified_attention_kernel"]  # a 1.7B MHA at 256 streams
