"""The C++ layer ops on CPU (kernels/csrc/layer_ops_cpu.cpp) through the layers that call them,
against the same layers' torch code: RMSNorm with and without its residual add, SiLU-and-mul,
and attention's rotary + K/V cache write (Qwen3's q/k norms, padding slots, rows cut from one
QKV output); in fp32, bf16 and fp16, at a decode step's rows and at a prefill's. Then when the
layers keep their torch code, and the kernels' own checks. Skipped where the kernels cannot be
built (no C++ toolchain): the layers then run their torch code, as the last tests check."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import cpu_layer_ops, torch_ops
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.layers import fused
from pagedserve.worker_svc.layers.activation import SiluAndMul
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.layers.norm import RMSNorm
from pagedserve.worker_svc.layers.rotary import RotaryEmbedding

from tests.kernels.conftest import TOLERANCES
from tests.kernels.gil import python_runs_during

KERNELS = cpu_layer_ops.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZE = 16


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _both_ways(layers: list[fused.FusedLayer], run):  # noqa: ANN001, ANN202
    """run() with the C++ ops, then with the torch code (the layers' kernels turned off)."""
    results = []
    for enabled in (True, False):
        for layer in layers:
            layer.enable_fused_kernels = enabled
        with torch.inference_mode():
            results.append(run())
    return results


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 300])  # 300: rows split over threads
def test_rms_norm_and_silu_and_mul_match_the_torch_code(dtype, num_rows):
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = _randn(576, dtype=dtype, seed=0)
    activation = SiluAndMul()
    wide = _randn(num_rows, 2 * 576, dtype=dtype, seed=1)
    x = wide[:, :576]  # rows of a wider tensor, read in place
    residual = _randn(num_rows, 576, dtype=dtype, seed=2)
    gate_up = _randn(num_rows, 2 * 1536, dtype=dtype, seed=3)
    kernel, plain = _both_ways([norm, activation], lambda: (
        norm(x), *norm(x, residual), activation(gate_up)))
    for a, b in zip(kernel, plain, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        _close(a, b, dtype)
    assert torch.equal(kernel[2], plain[2])  # the residual sum, rounded as torch's add
    assert torch.equal(kernel[3], plain[3])  # SiLU-and-mul: torch's own kernels


def _meta(slots: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """One token a sequence; sequence i's blocks are rows of block_tables."""
    num_seqs = len(slots)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.arange(num_seqs * 4, dtype=torch.int32).view(num_seqs, 4),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), num_prefills=0, num_prefill_tokens=0,
        query_lens_cpu=[1] * num_seqs, seq_lens_cpu=seq_lens)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_qk_norm", [False, True])
def test_attention_turns_and_writes_as_the_torch_code(dtype, has_qk_norm):
    """Three decode tokens of 9 query and 3 KV heads of 64, at positions across the table; the
    second token's slot is -1 (padding: not written). Its output and both caches."""
    heads, kv_heads, head = 9, 3, 64
    rotary = RotaryEmbedding(head, max_position=4096, base=100000.0)
    attention = Attention(heads, head, kv_heads, head ** -0.5, torch_ops, rotary)
    norms = None
    if has_qk_norm:
        norms = (RMSNorm(head, eps=1e-6).to(dtype), RMSNorm(head, eps=1e-6).to(dtype))
        for i, n in enumerate(norms):
            n.weight.data = _randn(head, dtype=dtype, seed=10 + i)
    qkv = _randn(3, (heads + 2 * kv_heads) * head, dtype=dtype, seed=4)
    positions = torch.tensor([5, 0, 4000])
    seq_lens = [6, 1, 4001 % (4 * BLOCK_SIZE) or 1]
    slots = [i * 4 * BLOCK_SIZE + (n - 1) for i, n in enumerate(seq_lens)]
    slots[1] = -1
    num_blocks = 3 * 4

    def run():  # noqa: ANN202
        kv_cache = _randn(2, num_blocks, BLOCK_SIZE, kv_heads, head, dtype=dtype, seed=5)
        q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
        out = attention(q, k, v, kv_cache, _meta(slots, seq_lens), positions, norms)
        return out, kv_cache

    (out, kv_cache), (expected_out, expected_cache) = _both_ways(
        [rotary, *(norms or ())], run)
    _close(out, expected_out, dtype)
    _close(kv_cache, expected_cache, dtype)
    untouched = _randn(2, num_blocks, BLOCK_SIZE, kv_heads, head, dtype=dtype, seed=5)
    written = kv_cache.flatten(1, 2) != untouched.flatten(1, 2)  # [2, slots, kv_heads, head]
    assert sorted(set(written.any(-1).any(-1).any(0).nonzero().flatten().tolist())) == [
        slots[0], slots[2]]


@needs_kernels
def test_the_layers_take_the_kernels_in_inference_and_the_torch_code_under_autograd(monkeypatch):
    norm, activation = RMSNorm(64), SiluAndMul()
    x = torch.randn(2, 64)
    assert norm.cpu_kernels(x) is None  # autograd on: the torch code's graph
    with torch.inference_mode():
        assert norm.cpu_kernels(x) is KERNELS
        monkeypatch.setattr(torch.Tensor, "pow", None)  # RMSNorm's torch code fails
        monkeypatch.setattr(torch.Tensor, "chunk", None)  # and SiLU-and-mul's
        norm(x, x)
        activation(torch.randn(2, 128))
        assert norm.cpu_kernels(x.to("meta")) is None
        norm.enable_fused_kernels = False
        assert norm.cpu_kernels(x) is None


def test_without_the_kernels_the_layers_run_their_torch_code(monkeypatch):
    monkeypatch.setattr(fused.cpu_layer_ops, "load", lambda: None)
    norm = RMSNorm(64)
    x, residual = torch.randn(2, 64), torch.randn(2, 64)
    with torch.inference_mode():
        assert norm.cpu_kernels(x) is None
        out, total = norm(x, residual)
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(out, norm._norm(x + residual))


@needs_kernels
def test_other_threads_run_while_they_compute():
    x = torch.randn(4096, 4096)  # 64 MB: milliseconds a call
    weight = torch.randn(4096)
    assert python_runs_during(lambda: KERNELS.fused_add_rms_norm(x, x, weight, 1e-6))


@needs_kernels
def test_positions_and_slots_outside_the_tables_are_refused():
    rotary = RotaryEmbedding(64, max_position=8, base=10000.0)
    query, key = torch.randn(1, 64), torch.randn(1, 64)
    kv_cache = torch.zeros(2, 2, BLOCK_SIZE, 1, 64)

    def call(position: int, slot: int) -> torch.Tensor:
        return KERNELS.rotary_write_kv(torch.tensor([position]), query, key, key,
                                       rotary.cos_sin_cache, kv_cache[0], kv_cache[1],
                                       torch.tensor([slot]))
    with pytest.raises(RuntimeError, match="position 8 of token 0 is outside the rotary"):
        call(8, 0)
    with pytest.raises(RuntimeError, match="slot 32 of token 0 is outside the cache's 32"):
        call(0, 32)
    with pytest.raises(RuntimeError, match="int64"):
        KERNELS.rotary_write_kv(torch.tensor([0], dtype=torch.int32), query, key, key,
                                rotary.cos_sin_cache, kv_cache[0], kv_cache[1],
                                torch.tensor([0]))
    assert not kv_cache.any()
