"""Paths of the torch backend that the shared batch kinds leave out: decodes of one length (no
mask), uniform prefill chunks, one step's plan reused by every layer's cache, and decodes (with
short prefills, as verification's few query tokens per sequence) both through the compiled CPU
kernel and through the gather + SDPA path taken without a compiler."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import cpu_decode, ref, torch_ops

from tests.kernels.batch import make_batch
from tests.kernels.conftest import TOLERANCES

PREFILLS = {
    "none": [],
    "fresh_one_length": [(0, 9), (0, 9)],
    "chunks_one_length": [(17, 8), (17, 8)],
    "ragged": [(0, 6), (13, 5)],
    # verifications (a decode and drafts) around a prompt chunk too long for the kernel
    "verify_and_long": [(20, 5), (3, 24), (31, 2)],
}
DECODES = {
    "none": [],
    "one_length": [(32, 1), (32, 1), (32, 1)],  # 33 keys: one past a block boundary
    "ragged": [(48, 1), (6, 1), (15, 1), (31, 1)],
}


@pytest.fixture(params=["in_place", "gather"])
def decode_path(request, monkeypatch) -> str:
    if request.param == "gather":
        monkeypatch.setattr(cpu_decode, "load", lambda: None)
    elif cpu_decode.load() is None:
        pytest.skip("no C++ toolchain here to build the CPU decode kernel")
    return request.param


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("decodes", list(DECODES))
@pytest.mark.parametrize("prefills", list(PREFILLS))
def test_one_plan_serves_every_layer(prefills, decodes, block_size, decode_path):
    """Two layers' caches (same NaN-filled free slots, different values) through one metadata:
    the second layer reuses the first one's plan and buffers and still matches the reference."""
    if prefills == decodes == "none":
        pytest.skip("empty batch")
    batch = make_batch(PREFILLS[prefills], DECODES[decodes], block_size=block_size, num_heads=6,
                       num_kv_heads=2, head_size=64, dtype=torch.float32,
                       seed=block_size + len(prefills) + len(decodes))
    layers = [(batch.query, batch.k_cache, batch.v_cache),
              (batch.query.flip(0), batch.k_cache * 2 - 1, batch.v_cache * -3 + 2)]
    for query, k_cache, v_cache in layers:
        out = torch_ops.paged_attention(query, k_cache, v_cache, batch.meta, 0.125)
        expected = ref.paged_attention(query, k_cache, v_cache, batch.meta, 0.125)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    plan = batch.meta.derived["torch"]
    if decodes != "none":
        assert (plan.decode.kv is None) == (decode_path == "in_place")
    if decodes == "one_length" and decode_path == "gather":
        assert plan.decode.attn_mask is None and plan.decode.kv.pad_rows is None
    if decode_path == "gather":
        if prefills == "fresh_one_length":
            assert plan.prefill.attn_mask is None
        return
    long_ids = [i for i, (_, q) in enumerate(PREFILLS[prefills]) if q > 17]
    assert (plan.prefill is None) == (not long_ids)
    if long_ids:
        assert plan.prefill.kv.num_seqs == len(long_ids)
