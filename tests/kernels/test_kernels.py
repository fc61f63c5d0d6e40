"""One parametrized test per op: every available backend × dtype × block size × head size (× GQA
ratio × batch shape for attention), against the reference or an exact expectation."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import ref

from tests.kernels.batch import BATCH_KINDS, make_batch
from tests.kernels.conftest import CACHE_OP_BACKENDS, FAST_BACKENDS, TARGETS, TOLERANCES

BLOCK_SIZES = [8, 16, 32]
HEAD_SIZES = [64, 128]
GQA_RATIOS = [1, 2, 4]
NUM_KV_HEADS = 2
# The Triton interpreter costs ~50 ms per program on CPU, so there it runs the batches that
# cover every path (the mixed batch holds a fresh prompt, a chunk after cached context and
# decodes); CUDA runs every batch kind.
INTERPRETER_KINDS = {"triton": ("mixed", "decodes"), "triton-split": ("mixed",)}


def _nan_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # [2, num_blocks, block_size, num_kv_heads, head_size]
    return torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                      dtype=dtype, device=device)


@pytest.mark.parametrize("num_skipped", [0, 3])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", CACHE_OP_BACKENDS)
def test_write_kv(ops, device, dtype, block_size, head_size, num_kv_heads, num_skipped):
    gen = torch.Generator().manual_seed(block_size + head_size)
    num_blocks, num_tokens = 5, 13
    kv_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[torch.tensor([2, 7, 12][:num_skipped], dtype=torch.long)] = -1  # padding rows
    # K and V as strided views into one projection output, the way a model hands them over.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen).to(device, dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # [num_tokens, num_kv_heads, head_size]

    ops.write_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping.to(device))

    expected = _nan_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[i]
            expected[1, slot // block_size, slot % block_size] = value[i]
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("kind", list(BATCH_KINDS))
@pytest.mark.parametrize("gqa", GQA_RATIOS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_paged_attention(backend, ops, device, dtype, block_size, head_size, gqa, kind):
    prefills, decodes = BATCH_KINDS[kind]
    if backend == "triton-split" and not decodes:
        pytest.skip("no decodes: the split-KV path does not apply")
    if device.type == "cpu" and kind not in INTERPRETER_KINDS.get(backend, BATCH_KINDS):
        pytest.skip("Triton interpreter: this batch's paths are covered by the mixed batch")
    batch = make_batch(prefills, decodes, block_size=block_size, num_heads=NUM_KV_HEADS * gqa,
                       num_kv_heads=NUM_KV_HEADS, head_size=head_size, dtype=dtype,
                       device=device, seed=block_size * gqa + head_size)
    scale = head_size ** -0.5

    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)

    expected = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    if backend == "triton-split":
        assert batch.meta.derived["triton"].num_split_decodes == len(decodes)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", CACHE_OP_BACKENDS)
def test_swap_blocks_round_trip(ops, device, dtype):
    """Swap out to host memory, lose the device copies, swap in elsewhere: exact KV back."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, 10, 16, 2, 64)  # [2, num_blocks, block_size, num_kv_heads, head_size]
    device_cache = torch.randn(shape, generator=gen).to(device, dtype)
    host_cache = torch.randn(2, 6, *shape[2:], generator=gen).to(dtype)
    original = device_cache.clone()
    host_before = host_cache.clone()

    ops.swap_blocks(device_cache, host_cache, torch.tensor([[3, 0], [7, 4], [1, 2]]))
    for src, dst in [(3, 0), (7, 4), (1, 2)]:
        assert torch.equal(host_cache[:, dst], original[:, src].cpu())
    for untouched in (1, 3, 5):
        assert torch.equal(host_cache[:, untouched], host_before[:, untouched])

    device_cache[:, [3, 7, 1]] = float("nan")  # the freed blocks get reused
    ops.swap_blocks(host_cache, device_cache, torch.tensor([[0, 5], [4, 8], [2, 9]]))
    for src, dst in [(3, 5), (7, 8), (1, 9)]:
        assert torch.equal(device_cache[:, dst], original[:, src])
    for untouched in (0, 2, 4, 6):
        assert torch.equal(device_cache[:, untouched], original[:, untouched])


@pytest.mark.parametrize("layout", ["separate", "one_allocation"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", CACHE_OP_BACKENDS)
def test_copy_blocks(ops, device, dtype, block_size, layout):
    gen = torch.Generator().manual_seed(block_size)
    num_layers, shape = 3, (2, 8, block_size, 2, 64)
    if layout == "separate":
        kv_caches = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(num_layers)]
    else:
        kv_caches = list(torch.randn(num_layers, *shape, generator=gen).to(device, dtype).unbind(0))
    before = [c.clone() for c in kv_caches]
    mapping = [(1, 4), (1, 6), (2, 5)]  # block 1 forked twice (n > 1), block 2 once

    ops.copy_blocks(kv_caches, torch.tensor(mapping))

    for kv_cache, old in zip(kv_caches, before, strict=True):
        expected = old.clone()
        for src, dst in mapping:
            expected[:, dst] = old[:, src]
        assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("kind", list(BATCH_KINDS))
def test_reference_keeps_to_the_inputs_device(kind):
    """The oracle of the CUDA cases: a tensor it made on the CPU (a causal mask, say) fails beside
    CUDA inputs. The meta device fails the same way, and on a CPU-only machine."""
    prefills, decodes = BATCH_KINDS[kind]
    batch = make_batch(prefills, decodes, block_size=8, num_heads=4, num_kv_heads=2,
                       head_size=64, dtype=torch.float32)
    query, k_cache, v_cache = (t.to("meta") for t in (batch.query, batch.k_cache, batch.v_cache))

    out = ref.paged_attention(query, k_cache, v_cache, batch.meta, 0.125)
    ref.write_kv(batch.key.to("meta"), batch.value.to("meta"), k_cache, v_cache,
                 batch.meta.slot_mapping)

    assert out.device.type == "meta" and out.shape == query.shape
