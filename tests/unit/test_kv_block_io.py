"""A worker's KV blocks as bytes for another worker (prefill/decode disaggregation): what one
cache reads, another writes into other block ids, every layer's K and V, nothing else touched;
a draft model's layers of their own KV shape go along; a wrong size is refused."""

from __future__ import annotations

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.worker_svc.cache_engine import CacheEngine, KVCacheSpec

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype=torch.float16)
WITH_DRAFT = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=4, block_size=4,
                         dtype=torch.float16, num_draft_layers=2, draft_num_kv_heads=1,
                         draft_head_size=8)


def _cache(spec: KVCacheSpec = SPEC) -> CacheEngine:
    return CacheEngine(spec, num_gpu_blocks=6, num_cpu_blocks=1, device=torch.device("cpu"),
                       backend=None)


@pytest.mark.parametrize("spec", [SPEC, WITH_DRAFT], ids=["target", "with-draft"])
def test_blocks_read_from_one_cache_land_in_other_block_ids_of_another(spec):
    source, target = _cache(spec), _cache(spec)
    for layer in source.gpu_cache + source.draft_gpu_cache:
        layer.copy_(torch.randn_like(layer))
    data = source.read_blocks([4, 1])
    assert len(data) == 2 * spec.bytes_per_block
    target.write_blocks([0, 5], data)
    layers = zip(source.gpu_cache + source.draft_gpu_cache,
                 target.gpu_cache + target.draft_gpu_cache, strict=True)
    for src, dst in layers:
        assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 5], src[:, 1])
        assert not dst[:, 1:5].any()


def test_a_blocks_bytes_are_the_targets_layers_then_the_drafts():
    """One layout every worker reads the same way: block-major, then layer, K before V."""
    cache = _cache(WITH_DRAFT)
    for i, layer in enumerate(cache.gpu_cache + cache.draft_gpu_cache):
        layer[0, 2] = 10 * i + 1
        layer[1, 2] = 10 * i + 2
    values = torch.frombuffer(bytearray(cache.read_blocks([2])), dtype=torch.float16).tolist()
    expected = []
    for i, (num_kv_heads, head_size) in enumerate(WITH_DRAFT.layer_shapes()):
        for kv in (1, 2):
            expected += [10 * i + kv] * (4 * num_kv_heads * head_size)
    assert values == expected
    assert WITH_DRAFT.bytes_per_block == 2 * 4 * 2 * (3 * 2 * 4 + 2 * 1 * 8)


def test_a_write_of_the_wrong_size_or_block_is_refused():
    cache = _cache()
    with pytest.raises(InvalidRequest, match="bytes"):
        cache.write_blocks([0], b"\0" * (SPEC.bytes_per_block - 2))
    with pytest.raises(InvalidRequest, match="out of range"):
        cache.write_blocks([6], b"\0" * SPEC.bytes_per_block)
    with pytest.raises(InvalidRequest, match="out of range"):
        cache.read_blocks([7])
