"""A worker's KV blocks as bytes for another worker (prefill/decode disaggregation): what one
cache reads, another writes into other block ids, every layer's K and V, nothing else touched;
a wrong size is refused."""

from __future__ import annotations

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.worker_svc.cache_engine import CacheEngine, KVCacheSpec

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=4, block_size=4, dtype=torch.float16)


def _cache() -> CacheEngine:
    return CacheEngine(SPEC, num_gpu_blocks=6, num_cpu_blocks=1, device=torch.device("cpu"),
                       backend=None)


def test_blocks_read_from_one_cache_land_in_other_block_ids_of_another():
    source, target = _cache(), _cache()
    for layer in source.gpu_cache:
        layer.copy_(torch.randn_like(layer))
    data = source.read_blocks([4, 1])
    assert len(data) == 2 * SPEC.bytes_per_block
    target.write_blocks([0, 5], data)
    for src, dst in zip(source.gpu_cache, target.gpu_cache, strict=True):
        assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 5], src[:, 1])
        assert not dst[:, 1:5].any()


def test_a_write_of_the_wrong_size_or_block_is_refused():
    cache = _cache()
    with pytest.raises(InvalidRequest, match="bytes"):
        cache.write_blocks([0], b"\0" * (SPEC.bytes_per_block - 2))
    with pytest.raises(InvalidRequest, match="out of range"):
        cache.write_blocks([6], b"\0" * SPEC.bytes_per_block)
    with pytest.raises(InvalidRequest, match="out of range"):
        cache.read_blocks([7])
