"""CUDA graphs: WarmUp captures the buckets, decode-only and mixed prefill + decode steps replay
them and give the eager path's greedy tokens and logits (float32), steps past the buckets run
eagerly, and the graphs' memory stays within what the memory profile reserved. Skipped without
CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.graph_buckets import capture_batch_sizes, capture_num_tokens
from pagedserve.worker_svc.memory import graph_memory_bytes

from tests.gpu.gpu_worker import cuda_worker, prompt
from tests.integration.worker_driver import Driver, assert_matches_hf
from tests.tiny_models import load_hf

pytestmark = pytest.mark.gpu

# three sequences (the bucket of 4, one padding row); as they reach the target length one by
# one the batch shrinks to 2 and 1, each its own bucket
PROMPT_LENS = {0: 11, 1: 5, 2: 30}
TARGET_LEN = 30 + 24


def _run(worker) -> Driver:
    driver = Driver(worker)
    for seq_id, n in PROMPT_LENS.items():
        driver.add(seq_id, prompt(seq_id, n))
    driver.step(dict(PROMPT_LENS))
    driver.run_to_length(list(PROMPT_LENS), TARGET_LEN)
    return driver


def test_warm_up_captures_every_bucket(tiny_model_dir):
    worker = cuda_worker(tiny_model_dir("llama"), enable_cuda_graph=True, max_num_seqs=20)
    graphs = worker.runner.decode_graphs
    assert sorted(graphs.graphs) == capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graphs.max_seq_len == min(worker.get_info().max_model_len, MAX_CAPTURE_SEQ_LEN)
    num_tokens = capture_num_tokens(512, 2048)
    assert sorted(worker.runner.mixed_graphs.graphs) == num_tokens == [8, 16, 32, 64, 128, 256,
                                                                       384, 512]
    assert worker.warm_up([2, 4]) == 2 + 8 and sorted(worker.runner.decode_graphs.graphs) == [2, 4]
    off = cuda_worker(tiny_model_dir("llama"), enable_cuda_graph=False)
    assert off.warm_up() == 0 and off.runner.decode_graphs is off.runner.mixed_graphs is None
    decode_only = cuda_worker(tiny_model_dir("llama"), enable_cuda_graph=True,
                              max_cuda_graph_tokens=0)
    assert decode_only.warm_up() == 4 and decode_only.runner.mixed_graphs is None
    torch_backend = cuda_worker(tiny_model_dir("llama"), backend="torch", enable_cuda_graph=True)
    assert torch_backend.warm_up() == 0


@pytest.mark.parametrize("partition_size", [512, 32], ids=["unified", "split-kv"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_graphs_give_the_eager_greedy_tokens(tiny_model_dir, monkeypatch, arch, partition_size):
    """32-token partitions make the graphs take the split-KV kernels (16 partitions for the
    512-token bound, most of them past every real length)."""
    monkeypatch.setattr("pagedserve.kernels.triton_ops.DECODE_PARTITION_SIZE", partition_size)
    path = tiny_model_dir(arch)
    eager = _run(cuda_worker(path, enable_cuda_graph=False))
    graphed = _run(cuda_worker(path, enable_cuda_graph=True))
    num_decode_steps = graphed.step_id - 1
    assert graphed.worker.runner.decode_graphs.num_replays == num_decode_steps > 0
    for seq_id in PROMPT_LENS:
        assert graphed.seqs[seq_id].token_ids == eager.seqs[seq_id].token_ids
    assert graphed.recorder.logits.keys() == eager.recorder.logits.keys()
    for key, row in graphed.recorder.logits.items():
        torch.testing.assert_close(row, eager.recorder.logits[key], atol=1e-4, rtol=0,
                                   msg=lambda m, k=key: f"(seq, position) {k}: {m}")
    hf = load_hf(path)
    for seq_id in PROMPT_LENS:
        assert_matches_hf(graphed, hf, seq_id, atol=2e-3)


def test_prefills_and_long_decodes_run_eagerly(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("pagedserve.worker_svc.worker.MAX_CAPTURE_SEQ_LEN", 24)
    path = tiny_model_dir("llama")
    worker = cuda_worker(path, enable_cuda_graph=True, max_cuda_graph_tokens=0)
    graphs = worker.runner.decode_graphs
    assert graphs.max_seq_len == 24
    driver = Driver(worker)
    driver.add(0, prompt(0, 11))
    driver.add(1, prompt(1, 5))
    driver.step({0: 11})
    driver.step({0: 1, 1: 5})  # a decode beside a prefill
    assert graphs.num_replays == 0
    expected_replays = 0
    while len(driver.seqs[0].token_ids) < 40:
        seq_len = max(len(driver.seqs[i].token_ids) for i in (0, 1))
        driver.step({0: 1, 1: 1})
        expected_replays += seq_len <= 24
        assert graphs.num_replays == expected_replays
    assert 0 < expected_replays < driver.step_id - 2
    hf = load_hf(path)
    for seq_id in (0, 1):
        assert_matches_hf(driver, hf, seq_id, atol=2e-3)


def test_graph_memory_stays_within_the_profile_reserve(tiny_model_dir):
    """bf16 at the default 256 sequences and 512 mixed tokens: 35 decode and 8 mixed graphs,
    their pool and outputs."""
    worker = cuda_worker(tiny_model_dir("llama"), dtype="bfloat16", enable_cuda_graph=True,
                         max_num_seqs=256)
    buckets = worker._graph_buckets()
    assert len(buckets.batch_sizes) == 35 and len(buckets.num_tokens) == 8
    reserve = graph_memory_bytes(worker.runner.model, worker.kv_spec, buckets, worker.device)
    # their pool goes back to the device
    worker.runner.decode_graphs = worker.runner.mixed_graphs = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    assert worker.warm_up() == 35 + 8
    held = torch.cuda.memory_reserved() - before
    assert 0 < held <= reserve, f"graphs hold {held} bytes, the profile reserved {reserve}"


# requests arriving while others decode: a prompt (or a chunk of one) beside decodes, in token
# buckets 8 .. 32; then decodes only, which replay a decode graph
ARRIVAL_PROMPT_LENS = {0: 11, 1: 5, 2: 30, 3: 17, 4: 9}
ARRIVALS = [{0: 11}, {0: 1, 1: 5}, {0: 1, 1: 1, 2: 20}, {0: 1, 1: 1, 2: 10, 3: 17},
            {0: 1, 1: 1, 2: 1, 3: 1, 4: 9}, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}]


def _run_arrivals(worker) -> Driver:
    driver = Driver(worker)
    for seq_id, n in ARRIVAL_PROMPT_LENS.items():
        driver.add(seq_id, prompt(seq_id, n))
    for schedule in ARRIVALS:
        driver.step(schedule)
    return driver


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_mixed_graphs_give_the_eager_greedy_tokens(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    eager = _run_arrivals(cuda_worker(path, enable_cuda_graph=False))
    graphed = _run_arrivals(cuda_worker(path, enable_cuda_graph=True))
    assert graphed.worker.runner.mixed_graphs.num_replays == len(ARRIVALS) - 1
    assert graphed.worker.runner.decode_graphs.num_replays == 1
    for seq_id in graphed.seqs:
        assert graphed.seqs[seq_id].token_ids == eager.seqs[seq_id].token_ids
    assert graphed.recorder.logits.keys() == eager.recorder.logits.keys()
    for key, row in graphed.recorder.logits.items():
        torch.testing.assert_close(row, eager.recorder.logits[key], atol=1e-4, rtol=0,
                                   msg=lambda m, k=key: f"(seq, position) {k}: {m}")
