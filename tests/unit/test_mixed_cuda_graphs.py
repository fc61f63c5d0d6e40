"""The CPU-checkable half of the mixed-step CUDA graphs: the bucket rule (shared with the
simulator), the static buffers a step is copied into (padding, reuse across steps of other
shapes), that the padded forward a graph records gives the real rows the eager forward's hidden
states and writes no KV for padding, and that mixed steps through the runner keep their tokens
(Triton under its interpreter)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from pagedserve.kernels.backend import available_backends
from pagedserve.services.common.config import ConfigError, DeviceConfig
from pagedserve.worker_svc.graph_buckets import (
    GraphBucket,
    GraphBuckets,
    capture_buckets,
    capture_num_tokens,
    graph_bucket,
    mixed_num_seqs,
)
from pagedserve.worker_svc.mixed_graphs import MixedBuffers, MixedGraphs, capture_graphs
from pagedserve.worker_svc.model_input import build_model_input
from torch import nn

from tests.integration.worker_driver import Driver, make_worker
from tests.unit.eager_graphs import with_eager_replays
from tests.unit.test_cuda_graph_buckets import _decodes, _seq

BLOCK_SIZE = 8
CPU = torch.device("cpu")


def _mixed() -> list:
    """A 9-token prompt chunk (prefills first), then three decodes: 12 tokens, 4 sequences."""
    return [_seq(5, 9, [2, 8], num_scheduled=9), *_decodes()]


def test_token_buckets_double_then_step_by_128_up_to_the_smaller_limit():
    assert capture_num_tokens(512, 2048) == [8, 16, 32, 64, 128, 256, 384, 512]
    assert capture_num_tokens(512, 300) == [8, 16, 32, 64, 128, 256, 300]
    assert capture_num_tokens(1000, 2048)[-4:] == [640, 768, 896, 1000]
    assert capture_num_tokens(100, 2048) == [8, 16, 32, 64, 100]
    assert capture_num_tokens(8, 2048) == [8]
    assert capture_num_tokens(5, 2048) == [5]
    assert capture_num_tokens(0, 2048) == capture_num_tokens(1, 2048) == []
    with pytest.raises(ConfigError, match="max_cuda_graph_tokens must be >= 0, got -1"):
        DeviceConfig(max_cuda_graph_tokens=-1)


def test_every_step_up_to_the_largest_bucket_replays_one():
    buckets = capture_buckets(max_num_seqs=16, max_num_batched_tokens=2048,
                              max_cuda_graph_tokens=64, max_seq_len=100)
    assert buckets.batch_sizes == [1, 2, 4, 8, 16] and buckets.num_tokens == [8, 16, 32, 64]

    def pick(num_seqs, num_tokens, is_decode_only, max_seq_len=50):
        return graph_bucket(buckets, num_seqs, num_tokens, is_decode_only, max_seq_len)

    assert pick(3, 3, True) == GraphBucket(is_mixed=False, size=4)
    # a mixed step: the smallest token bucket that holds it
    assert pick(4, 12, False) == GraphBucket(is_mixed=True, size=16)
    assert pick(2, 64, False) == GraphBucket(is_mixed=True, size=64)
    assert pick(1, 8, False) == GraphBucket(is_mixed=True, size=8)
    # decodes past the largest decode bucket are a mixed graph's rows
    wide = GraphBuckets([1, 2], [8, 16], max_seq_len=100, max_num_seqs=16)
    assert graph_bucket(wide, 5, 5, True, 50) == GraphBucket(is_mixed=True, size=8)
    # eager: past the largest bucket, past the capture length (inclusive bound), more
    # sequences than the graph has slots for
    assert pick(4, 65, False) is None
    assert pick(4, 12, False, max_seq_len=100) is not None
    assert pick(4, 12, False, max_seq_len=101) is None
    assert pick(3, 3, True, max_seq_len=101) is None
    assert mixed_num_seqs(64, 16) == 17 and mixed_num_seqs(8, 16) == 9
    assert pick(17, 40, False) is None
    no_mixed = capture_buckets(16, 2048, 0, 100)
    assert graph_bucket(no_mixed, 4, 12, False, 50) is None


def test_load_pads_the_bucket_and_overwrites_a_larger_step():
    buffers = MixedBuffers.allocate(max_num_tokens=32, max_num_seqs=9, max_blocks_per_seq=6,
                                    device=CPU)
    larger = build_model_input([_seq(7, 20, [1, 5, 10], num_scheduled=20), *_decodes(),
                                _seq(3, 30, [13, 14, 15, 0]), _seq(4, 3, [12])], BLOCK_SIZE, CPU)
    buffers.load(larger, 32, 9)
    step = build_model_input(_mixed(), BLOCK_SIZE, CPU)
    buffers.load(step, 16, 5)  # 12 tokens of 4 sequences, in the bucket of 16 tokens, 5 slots
    assert buffers.input_ids[:16].tolist() == [*step.input_ids.tolist(), 0, 0, 0, 0]
    assert buffers.positions[:16].tolist() == [*range(9), 11, 19, 4, 0, 0, 0, 0]
    # padding writes no KV
    assert buffers.slot_mapping[:16].tolist() == [*step.meta.slot_mapping.tolist(), -1, -1, -1, -1]
    # the last slot owns the 4 padding tokens, as a prompt over block 0
    assert buffers.query_start_loc[:6].tolist() == [0, 9, 10, 11, 12, 16]
    assert buffers.seq_lens[:5].tolist() == [9, 12, 20, 5, 4]
    assert buffers.block_tables[:4, :3].tolist() == [[2, 8, 0], [9, 3, 0], [4, 11, 7], [6, 0, 0]]
    assert buffers.block_tables[4].tolist() == [0] * 6
    # with a free slot between the step's sequences and the padding owner: it has no queries
    buffers.load(step, 16, 6)
    assert buffers.query_start_loc[:7].tolist() == [0, 9, 10, 11, 12, 12, 16]
    assert buffers.seq_lens[4:6].tolist() == [0, 4]
    meta = buffers.metadata(16, 6, max_seq_len=64)
    # host fields hold bounds: every slot taken by the unified kernel, no split-KV decode
    assert (meta.num_prefills, meta.max_query_len, meta.num_prefill_tokens) == (6, 16, 16)
    assert meta.seq_lens_cpu == [64] * 6 and meta.query_lens_cpu == [16] * 6
    assert meta.block_tables.shape[0] == 6 and meta.slot_mapping.shape[0] == 16
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(step, 8, 5)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(step, 16, 4)  # no slot left for the padding's owner


def _triton_worker(arch: str):
    if "triton" not in available_backends(CPU):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    return make_worker(arch, num_gpu_blocks=32, num_cpu_blocks=0, block_size=BLOCK_SIZE,
                       backend="triton")


def test_padded_static_forward_equals_eager_and_padding_writes_no_kv(tiny_model_dir):
    worker = _triton_worker(tiny_model_dir("llama"))
    model, kv_caches = worker.runner.model, worker.cache_engine.gpu_cache
    generator = torch.Generator().manual_seed(0)
    for layer in kv_caches:
        layer.copy_(torch.randn(layer.shape, generator=generator))
    step = build_model_input(_mixed(), BLOCK_SIZE, CPU)
    buckets = capture_buckets(max_num_seqs=4, max_num_batched_tokens=2048,
                              max_cuda_graph_tokens=16, max_seq_len=48)
    with torch.inference_mode():
        eager = model(step.input_ids, step.positions, kv_caches, step.meta)  # [12, hidden]
        after_eager = [layer.clone() for layer in kv_caches]
        graphs = MixedGraphs(model, buckets, block_size=BLOCK_SIZE, device=CPU)
        graphs.buffers.load(step, 16, graphs.num_seqs(16))
        static = graphs.run_static(16, kv_caches)  # [16, hidden]
    torch.testing.assert_close(static[:12], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(static[12:]).all()
    # the real rows rewrote their own slots; a padding token writing anywhere (block 0
    # included) would show as a gross change
    for before, after in zip(after_eager, kv_caches, strict=True):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert graphs.num_tokens_for(step, kv_caches) is None  # nothing captured on this cache


def _stand_in_graphs(worker, buckets: GraphBuckets) -> MixedGraphs:
    kv_caches = worker.cache_engine.gpu_cache
    graphs = MixedGraphs(worker.runner.model, buckets, block_size=BLOCK_SIZE, device=CPU)
    return with_eager_replays(graphs, graphs.num_tokens, kv_caches)


def test_mixed_steps_take_the_graph_path_and_keep_their_tokens(tiny_model_dir):
    """Requests arriving while others decode, through real steps of changing shapes (one static
    buffer set for all), with CUDA graphs stood in for by EagerReplay: the same tokens and
    logits as eager steps, one sample per sampling sequence and none for padding."""
    buckets = capture_buckets(max_num_seqs=8, max_num_batched_tokens=2048,
                              max_cuda_graph_tokens=32, max_seq_len=64)
    prompts = {0: 7, 1: 13, 2: 5, 3: 20}
    drivers, samples = [], []
    for is_graphed in (False, True):
        worker = _triton_worker(tiny_model_dir("qwen2"))
        if is_graphed:
            worker.runner.mixed_graphs = _stand_in_graphs(worker, buckets)
        driver = Driver(worker)
        for seq_id, n in prompts.items():
            driver.add(seq_id, [5 + 7 * seq_id + i for i in range(n)])
        counts = [len(driver.step({0: 7}).sampled_by_seq())]  # 7 tokens: bucket 8
        counts.append(len(driver.step({0: 1, 1: 13}).sampled_by_seq()))  # 14: bucket 16
        counts.append(len(driver.step({0: 1, 1: 1, 2: 3}).sampled_by_seq()))  # 5, a chunk: bucket 8
        counts.append(len(driver.step({0: 1, 1: 1, 2: 2, 3: 20}).sampled_by_seq()))  # 24: bucket 32
        counts.append(len(driver.step({0: 1, 1: 1, 2: 1, 3: 1}).sampled_by_seq()))  # decodes: eager
        drivers.append(driver)
        samples.append(counts)
    eager, graphed = drivers
    assert graphed.worker.runner.mixed_graphs.num_replays == 4
    assert samples[0] == samples[1] == [1, 2, 2, 4, 4]  # the chunk of seq 2 samples nothing
    for seq_id in prompts:
        assert graphed.seqs[seq_id].token_ids == eager.seqs[seq_id].token_ids
    assert graphed.recorder.logits.keys() == eager.recorder.logits.keys()
    for key, row in graphed.recorder.logits.items():
        torch.testing.assert_close(row, eager.recorder.logits[key], atol=1e-4, rtol=0)


class _ShapeRecorder(nn.Module):
    """A model that notes each forward's token count and the pool being captured into."""

    def __init__(self, capturing: dict) -> None:
        super().__init__()
        self.capturing = capturing
        self.calls: list[tuple[int, object]] = []

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        self.calls.append((input_ids.shape[0], self.capturing.get("pool")))
        return torch.zeros(input_ids.shape[0], 4)


def test_both_kinds_capture_largest_first_into_one_pool_after_a_warm_up(monkeypatch):
    """The memory profile reserves the largest graph's peak only: every graph of both kinds
    goes into one pool, the largest first (here the 16-token mixed graph), each after an
    eager run outside the capture."""
    capturing: dict = {}

    @contextlib.contextmanager
    def graph(_graph, pool):
        capturing["pool"] = pool
        yield
        capturing.pop("pool")

    pools = iter(["pool-0", "pool-1"])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    buckets = capture_buckets(max_num_seqs=4, max_num_batched_tokens=2048,
                              max_cuda_graph_tokens=16, max_seq_len=48)
    model = _ShapeRecorder(capturing)
    kv_caches = [torch.zeros(1)]
    decode, mixed = capture_graphs(model, buckets, BLOCK_SIZE, kv_caches, CPU)
    assert model.calls == [(16, None), (16, "pool-0"), (8, None), (8, "pool-0"),
                           (4, None), (4, "pool-0"), (2, None), (2, "pool-0"),
                           (1, None), (1, "pool-0")]
    assert sorted(decode.graphs) == [1, 2, 4] and sorted(mixed.graphs) == [8, 16]
    assert decode.kv_caches is kv_caches and mixed.kv_caches is kv_caches
    assert mixed.hidden_states[16].shape == (16, 4)
