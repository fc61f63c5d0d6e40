"""The fused layer ops (RMSNorm with its residual add, SiLU-and-mul, rotary embedding + K/V cache
write) against `kernels.ref`: the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) and,
on CUDA, the custom ops the layers call; then the layers' fused path against their torch code."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest
import torch
from pagedserve.kernels import ref
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.layers.activation import SiluAndMul
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.layers.norm import RMSNorm
from pagedserve.worker_svc.layers.rotary import RotaryEmbedding

from tests.kernels.conftest import TARGETS, TOLERANCES

IMPLS = ["triton", "layer_ops"]
CUDA_TARGETS = [p for p in TARGETS if p.id.startswith("cuda")]


@pytest.fixture
def impl_ops(impl: str, device: torch.device) -> ModuleType:
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if impl == "layer_ops":
        if device.type != "cuda":
            pytest.skip("the custom ops run the references on CPU")
        from pagedserve.kernels import layer_ops
        return layer_ops
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1")
    from pagedserve.kernels import triton_layer_ops
    return triton_layer_ops


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype],
                               equal_nan=True)


@pytest.mark.parametrize("is_per_head", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm(impl_ops, device, dtype, hidden, has_residual, is_per_head):
    """is_per_head: [num_tokens, heads, head_size] rows cut from a wider tensor (Qwen3's
    q/k norms read the QKV projection's output in place)."""
    x = _randn(5, 3 * hidden + 8, dtype=dtype, device=device, seed=hidden)
    x = x[:, :3 * hidden].unflatten(1, (3, hidden)) if is_per_head else x[:, 8:hidden + 8]
    weight = _randn(hidden, dtype=dtype, device=device, seed=1)
    if has_residual:
        residual = _randn(*x.shape, dtype=dtype, device=device, seed=2)
        out, summed = impl_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        expected_out, expected_sum = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
        _close(summed, expected_sum, dtype)
    else:
        out, expected_out = impl_ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, expected_out, dtype)


@pytest.mark.parametrize("intermediate", [48, 1500])  # 1500: more than one column tile
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("impl", IMPLS)
def test_silu_and_mul(impl_ops, device, dtype, intermediate):
    x = _randn(3, 2 * intermediate, dtype=dtype, device=device, seed=intermediate)
    out = impl_ops.silu_and_mul(x)
    assert out.shape == (3, intermediate)
    _close(out, ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("is_split_view", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (4, 2), (3, 3)])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("impl", IMPLS)
def test_rotary_write_kv(impl_ops, device, dtype, head_size, num_heads, num_kv_heads,
                         is_split_view):
    """is_split_view: query, key and value are the QKV projection's column slices; else
    [num_tokens, heads, head_size] tensors of their own. Slot -1 writes nothing; the cache
    slots no token maps to stay NaN."""
    num_tokens, num_blocks, block_size = 7, 3, 8
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype,
                 device=device, seed=head_size + num_heads)
    query, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                                   num_kv_heads * head_size], dim=-1)
    if not is_split_view:
        query, key, value = (t.reshape(num_tokens, -1, head_size).contiguous()
                             for t in (query, key, value))
    rotary = RotaryEmbedding(head_size, max_position=64, base=10000.0).to(device)
    positions = torch.tensor([0, 1, 2, 40, 41, 63, 5], device=device)
    slot_mapping = torch.tensor([3, 17, -1, 0, 9, 23, 8], device=device)
    caches = [torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                         dtype=dtype, device=device) for _ in range(2)]
    out = impl_ops.rotary_write_kv(positions, query, key, value, rotary.cos_sin_cache,
                                   caches[0][0], caches[0][1], slot_mapping)
    expected = ref.rotary_write_kv(positions, query, key, value, rotary.cos_sin_cache,
                                   caches[1][0], caches[1][1], slot_mapping)
    assert out.shape == (num_tokens, num_heads, head_size)
    _close(out, expected, dtype)
    _close(caches[0], caches[1], dtype)
    assert caches[0].isnan().sum() == caches[1].isnan().sum() > 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("impl", IMPLS)
def test_rotary_write_kv_with_qk_norm_is_the_norms_then_the_rotary(impl_ops, device, dtype):
    """Qwen3's per-head q/k RMSNorms in the rotary kernel: the same query and cache as the
    reference norms each head (rms_norm) and then turns it, in two launches."""
    num_tokens, num_heads, num_kv_heads, head_size = 5, 4, 2, 128
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype,
                 device=device, seed=7)
    query, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size,
                                   num_kv_heads * head_size], dim=-1)
    q_weight, k_weight = (_randn(head_size, dtype=dtype, device=device, seed=s) for s in (8, 9))
    rotary = RotaryEmbedding(head_size, max_position=64, base=10000.0).to(device)
    positions = torch.tensor([0, 9, 40, 63, 2], device=device)
    slot_mapping = torch.tensor([3, -1, 0, 9, 15], device=device)
    caches = [torch.zeros(2, 2, 8, num_kv_heads, head_size, dtype=dtype, device=device)
              for _ in range(2)]
    out = impl_ops.rotary_write_kv(positions, query, key, value, rotary.cos_sin_cache,
                                   caches[0][0], caches[0][1], slot_mapping, q_weight, k_weight,
                                   1e-6)
    normed_query = ref.rms_norm(query.unflatten(-1, (num_heads, head_size)), q_weight, 1e-6)
    normed_key = ref.rms_norm(key.unflatten(-1, (num_kv_heads, head_size)), k_weight, 1e-6)
    expected = ref.rotary_write_kv(positions, normed_query, normed_key, value,
                                   rotary.cos_sin_cache, caches[1][0], caches[1][1],
                                   slot_mapping)
    _close(out, expected, dtype)
    _close(caches[0], caches[1], dtype)
    assert caches[0][0].abs().sum() > 0


def test_the_reference_rotary_is_the_layers():
    """fp32: the fused path's reference turns query and key as RotaryEmbedding does."""
    rotary = RotaryEmbedding(64, max_position=32, base=10000.0)
    positions = torch.tensor([3, 0, 31])
    query, key = torch.randn(3, 2 * 64), torch.randn(3, 64)
    kv_cache = torch.zeros(2, 3, 1, 1, 64)  # three blocks of one slot
    rotated_query, rotated_key = rotary(positions, query, key)
    out = ref.rotary_write_kv(positions, query, key, key, rotary.cos_sin_cache, kv_cache[0],
                              kv_cache[1], torch.tensor([0, 1, 2]))
    torch.testing.assert_close(out, rotated_query)
    torch.testing.assert_close(kv_cache[0].flatten(0, 1), rotated_key)


def test_cpu_keeps_the_torch_code_and_the_gpu_path_is_one_op_per_layer():
    """CPU under autograd runs the layers' torch code (in inference, their C++ ops:
    test_cpu_layer_ops.py); on meta (as on CUDA) each layer is one custom op."""
    norm, activation = RMSNorm(64), SiluAndMul()
    x = torch.randn(3, 64)
    assert not norm.is_fused(x) and not activation.is_fused(x)
    torch.testing.assert_close(norm(x), ref.rms_norm(x, norm.weight, norm.eps))
    meta = x.to("meta")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        norm(meta, meta)
        activation(meta)
    ops = {e.name for e in prof.events()}
    assert {"pagedserve::fused_add_rms_norm", "pagedserve::silu_and_mul"} <= ops
    assert not {"aten::pow", "aten::rsqrt", "aten::silu"} & ops
    norm.enable_fused_kernels = False
    assert not norm.is_fused(meta)


def _decode_meta(num_tokens: int, device: torch.device) -> AttentionMetadata:
    """One-token sequences in blocks 0..num_tokens-1 of size 16."""
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device) * 16,
        block_tables=torch.arange(num_tokens, dtype=torch.int32, device=device).unsqueeze(1),
        seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=1, num_prefills=0, num_prefill_tokens=0,
        query_lens_cpu=[1] * num_tokens, seq_lens_cpu=[1] * num_tokens)


@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_layers_run_the_fused_kernels_on_cuda_and_match_their_torch_code(target):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedserve.kernels import triton_ops
    device, dtype = torch.device("cuda"), target[1]
    norm = RMSNorm(256, eps=1e-5).to(device, dtype)
    rotary = RotaryEmbedding(64, max_position=64, base=10000.0).to(device)
    attention = Attention(4, 64, 2, 0.125, triton_ops, rotary)
    x, residual = (_randn(6, 256, dtype=dtype, device=device, seed=s) for s in (1, 2))
    qkv = _randn(6, 8 * 64, dtype=dtype, device=device, seed=3)
    positions = torch.tensor([0, 5, 9, 17, 33, 63], device=device)
    results = []
    for enabled in (True, False):
        for layer in (norm, rotary):
            layer.enable_fused_kernels = enabled
        activation = SiluAndMul()
        activation.enable_fused_kernels = enabled
        assert norm.is_fused(x) == enabled
        kv_cache = torch.zeros(2, 6, 16, 2, 64, dtype=dtype, device=device)
        q, k, v = qkv.split([256, 128, 128], dim=-1)
        results.append((norm(x), *norm(x, residual), activation(qkv), kv_cache,
                        attention(q, k, v, kv_cache, _decode_meta(6, device), positions)))
    for fused, plain in zip(*results, strict=True):
        _close(fused, plain, dtype)
