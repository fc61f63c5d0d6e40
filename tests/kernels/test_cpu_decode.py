"""The compiled CPU decode kernel against the reference: contexts over many blocks and split into
chunks, every GQA ratio the models use, the head sizes with a vector path (64, 128) and one off
its 16-lane stride, the CPU cache dtypes. Skipped where no compiler can build it (the torch
backend then takes the gather path, tested in test_torch_ops)."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import cpu_decode, ref

from tests.kernels.batch import make_batch
from tests.kernels.conftest import TOLERANCES
from tests.kernels.gil import python_runs_during

KERNEL = cpu_decode.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain here")

# decodes only: (context_len, 1); lengths cross block boundaries on both sides
DECODES = [(300, 1), (0, 1), (15, 1), (16, 1), (129, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 36])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_reference(block_size, gqa, head_size, dtype):
    batch = make_batch([], DECODES, block_size=block_size, num_heads=2 * gqa, num_kv_heads=2,
                       head_size=head_size, dtype=dtype, seed=block_size + gqa + head_size)
    meta = batch.meta
    out = cpu_decode.paged_decode_attention(KERNEL, batch.query, batch.k_cache, batch.v_cache,
                                            meta.block_tables, meta.seq_lens, 0.1)
    expected = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, meta, 0.1)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_non_contiguous_query_and_block_table_rows():
    """The worker hands in a query split off the fused QKV projection and the decode rows of a
    block table that starts with prefills."""
    batch = make_batch([(0, 5)], DECODES, block_size=16, num_heads=6, num_kv_heads=2,
                       head_size=64, dtype=torch.float32, seed=7)
    meta = batch.meta
    fused = torch.cat([batch.query, torch.zeros_like(batch.query)], dim=1)
    query = fused[:, :6][5:]  # [num_decodes, 6, 64], rows strided
    out = cpu_decode.paged_decode_attention(KERNEL, query, batch.k_cache, batch.v_cache,
                                            meta.block_tables[1:], meta.seq_lens[1:], 0.125)
    expected = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, meta, 0.125)[5:]
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_other_threads_run_while_it_computes():
    batch = make_batch([], [(2000, 1)] * 16, block_size=16, num_heads=4, num_kv_heads=4,
                       head_size=128, dtype=torch.float32)  # 131 MB of K/V: milliseconds a call
    meta = batch.meta
    assert python_runs_during(lambda: cpu_decode.paged_decode_attention(
        KERNEL, batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
        0.1))


def test_rejects_a_block_table_of_another_dtype():
    batch = make_batch([], DECODES[:2], block_size=16, num_heads=2, num_kv_heads=2,
                       head_size=64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_decode.paged_decode_attention(KERNEL, batch.query, batch.k_cache, batch.v_cache,
                                          batch.meta.block_tables.long(), batch.meta.seq_lens,
                                          0.125)
